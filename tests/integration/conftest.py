"""Coordinator replicas and a monitor as real gRPC servers in this process, on free ports; an
etcd with a small quota."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import pytest

from services.cli.stack import etcd_argv, etcd_healthy, free_ports
from services.common.config import EtcdSettings, ServiceSettings
from services.common.keys import KeySpace
from services.common.registry import MemberRecord
from services.common.runtime import ServiceRuntime
from services.coordinator.config import CoordinatorSettings
from services.coordinator.server import serve as serve_coordinator
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from tests.support import eventually, eventually_sync


async def leader_of(runtimes: list[ServiceRuntime]) -> ServiceRuntime | None:
    from services.common.election import current_leader

    for runtime in runtimes:
        if runtime.client is None:
            continue
        entry = await current_leader(runtime.client, runtime.keys.election("coordinator"))
        if entry is None:
            return None
        for candidate in runtimes:
            if candidate.instance_id.encode() in entry.value:
                return candidate
    return None


async def accepts_writes(runtime: ServiceRuntime) -> bool:
    """The replica answers a write as the leader (done taking over), not UNAVAILABLE."""
    import grpc

    from robustrl.v1 import coordinator_pb2, coordinator_pb2_grpc

    async with grpc.aio.insecure_channel(runtime.address) as channel:
        try:
            await coordinator_pb2_grpc.CoordinatorStub(channel).CancelJob(
                coordinator_pb2.CancelJobRequest(job_id="readiness-probe"), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
    return True


@pytest.fixture
async def monitor(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    runtime = await serve_monitor(
        MonitorSettings(instance_id="monitor-0", reconnect_grace=0.5), etcd_settings
    )
    yield runtime
    await runtime.shutdown()


async def start_coordinators(
    etcd_settings: EtcdSettings, **settings: object
) -> list[ServiceRuntime]:
    """Two replicas, ordered leader first once one leads and takes writes."""
    runtimes = [
        await serve_coordinator(
            CoordinatorSettings(
                instance_id=f"coordinator-{i}",
                heartbeat_interval=0.2,
                **settings,  # type: ignore[arg-type]
            ),
            etcd_settings,
        )
        for i in range(2)
    ]

    async def elected() -> bool:
        leader = await leader_of(runtimes)
        return leader is not None and await accepts_writes(leader)

    await eventually(elected, timeout=10)
    leader = await leader_of(runtimes)
    assert leader is not None
    return [leader, *[r for r in runtimes if r is not leader]]


@pytest.fixture
async def coordinators(
    etcd_settings: EtcdSettings, monitor: ServiceRuntime
) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas with the local provisioner; the list is ordered leader first."""
    runtimes = await start_coordinators(etcd_settings)
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown()


@pytest.fixture
async def external_coordinators(
    etcd_settings: EtcdSettings,
) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas that take an external provisioner; leader first."""
    runtimes = await start_coordinators(etcd_settings, provisioner="external")
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown()


@dataclass(frozen=True)
class EtcdMember:
    endpoint: str
    """Its client endpoint, host:port."""
    pid: int


@contextlib.contextmanager
def small_etcds(tmp_path: Path, count: int) -> Iterator[list[EtcdMember]]:
    """`count` etcd members in one cluster, each with a 1 MiB quota. Stopped by pid on the way
    out."""
    ports = free_ports(2 * count)
    names = [f"small{i}" for i in range(count)]
    cluster = ",".join(f"{n}=http://127.0.0.1:{ports[2 * i + 1]}" for i, n in enumerate(names))
    procs = [
        subprocess.Popen(
            [
                *etcd_argv(n, tmp_path / n, ports[2 * i], ports[2 * i + 1], cluster),
                "--quota-backend-bytes=1048576",
                "--log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, n in enumerate(names)
    ]
    members = [EtcdMember(f"127.0.0.1:{ports[2 * i]}", proc.pid) for i, proc in enumerate(procs)]
    try:
        for member in members:
            eventually_sync(functools.partial(etcd_healthy, member.endpoint), timeout=30)
        yield members
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[str]:
    """An etcd with a 1 MiB quota; its client endpoint."""
    with small_etcds(tmp_path, 1) as (member,):
        yield member.endpoint


async def fill_etcd(client: aetcd.Client, prefix: str, *, one_key: bool) -> int:
    """Put 100 KB values under `prefix` (all to one key, or each to its own) until etcd
    refuses with NOSPACE; how many landed."""
    landed = 0
    with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
        while landed < 1000:
            key = f"{prefix}/fill/{0 if one_key else landed}".encode()
            await client.put(key, os.urandom(100_000))
            landed += 1
    return landed


async def started_member(
    role: str, instance_id: str, settings: EtcdSettings, labels: dict[str, str] | None = None
) -> ServiceRuntime:
    """A started ServiceRuntime with no services and no heartbeats: a registry member only."""
    runtime = ServiceRuntime(
        role,
        ServiceSettings(instance_id=instance_id),
        settings,
        service_names=[],
        heartbeats=False,
        labels=labels,
    )
    await runtime.start()
    return runtime


async def stored_member(
    client: aetcd.Client, settings: EtcdSettings, role: str, instance_id: str
) -> MemberRecord | None:
    raw = await client.get(KeySpace(settings.prefix).member(role, instance_id))
    return None if raw is None else MemberRecord.model_validate_json(raw.value)
