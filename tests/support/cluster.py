"""Services started in the test's process against the test's etcd: coordinators, members,
small etcds."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from robustrl.cli.stack import etcd_argv, etcd_healthy, free_ports
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import coordinator_pb2_grpc
from services.coordinator.config import CoordinatorSettings
from services.coordinator.driver import JobDriver
from services.coordinator.leadership import Leadership
from services.coordinator.server import serve as serve_coordinator
from tests.support import eventually, eventually_sync


async def leader_of(runtimes: list[ServiceRuntime]) -> ServiceRuntime | None:
    from robustrl.core.election import current_leader

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


SPEC = "name: arith\ntrainer: {steps: 3}\n"


def stub(runtime: ServiceRuntime) -> tuple[grpc.aio.Channel, coordinator_pb2_grpc.CoordinatorStub]:
    channel = grpc.aio.insecure_channel(runtime.address)
    return channel, coordinator_pb2_grpc.CoordinatorStub(channel)


async def code_of(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


@contextlib.asynccontextmanager
async def lone_leader(
    etcd_settings: EtcdSettings, name: str, **driver_options: Any
) -> AsyncIterator[tuple[ServiceRuntime, Leadership, JobDriver]]:
    """One coordinator runtime that has won its election, with a driver that does not tick on
    its own (the test calls it); stopped on the way out."""
    settings = CoordinatorSettings(instance_id=f"coordinator-{name}", heartbeat_interval=0.2)
    runtime = ServiceRuntime("coordinator", settings, etcd_settings, service_names=[])

    async def elected() -> None:
        await driver.on_elected()

    leadership = Leadership(runtime, name, elected)
    driver = JobDriver(runtime, leadership, tick_interval=60, lease_seconds=60, **driver_options)
    await runtime.start()
    driver.jobs.start()  # the registry it reads, without the rounds
    leadership.start()
    try:

        async def leads() -> bool:
            return leadership.is_leader

        await eventually(leads, timeout=10)
        yield runtime, leadership, driver
    finally:
        await leadership.resign()
        await driver.stop()
        await runtime.shutdown()
