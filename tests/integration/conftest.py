"""Coordinator replicas and a monitor as real gRPC servers in this process, on free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import EtcdSettings
from services.common.runtime import ServiceRuntime
from services.coordinator.config import CoordinatorSettings
from services.coordinator.server import serve as serve_coordinator
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from tests.support import eventually


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


@pytest.fixture
async def coordinators(
    etcd_settings: EtcdSettings, monitor: ServiceRuntime
) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas; the list is ordered leader first once one leads."""
    runtimes = [
        await serve_coordinator(
            CoordinatorSettings(instance_id=f"coordinator-{i}", heartbeat_interval=0.2),
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
    ordered = [leader, *[r for r in runtimes if r is not leader]]
    yield ordered
    for runtime in runtimes:
        await runtime.shutdown()
