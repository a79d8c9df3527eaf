"""Several monitors against a real etcd, as real gRPC servers in this process: the beats split
by the assignment and move when the monitors change, a failure is recorded once whoever finds
it, and a monitor forgets the members that left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from robustrl.contracts.incidents import IncidentSubject, failure_mark, new_incident
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.assignment import owner
from robustrl.core.config import EtcdSettings
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.heartbeat import HeartbeatSender, Progress
from robustrl.core.incident_log import IncidentLog
from robustrl.core.registry import Registry
from robustrl.core.runtime import ServiceRuntime
from robustrl.core.session import Session
from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc
from services.monitor import server as monitor_server
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from tests.support import eventually

MEMBERS = 12


async def start_monitor(
    etcd: EtcdSettings, name: str, view_retention: float = 60.0
) -> ServiceRuntime:
    settings = MonitorSettings(instance_id=name, reconnect_grace=0.5, view_retention=view_retention)
    return await serve_monitor(settings, etcd)


@contextlib.asynccontextmanager
async def monitors(etcd: EtcdSettings, *names: str) -> AsyncIterator[list[ServiceRuntime]]:
    started = [await start_monitor(etcd, name) for name in names]
    try:
        yield started
    finally:
        for runtime in started:
            await runtime.shutdown()


def sender(runtime: ServiceRuntime, instance_id: str) -> HeartbeatSender:
    assert runtime.client is not None
    beats = HeartbeatSender(
        Registry(runtime.client, runtime.keys),
        role=common_pb2.ROLE_ROLLOUT,
        instance_id=instance_id,
        progress=Progress(phase="generate", counters={"tokens_generated": 1.0}),
        interval=0.1,
    )
    beats.start()
    return beats


async def health(
    runtime: ServiceRuntime, page_size: int = 0, page_token: str = ""
) -> monitor_pb2.GetHealthResponse:
    async with grpc.aio.insecure_channel(runtime.address) as channel:
        reply: monitor_pb2.GetHealthResponse = await monitor_pb2_grpc.MonitorStub(
            channel
        ).GetHealth(
            monitor_pb2.GetHealthRequest(page_size=page_size, page_token=page_token), timeout=5
        )
        return reply


async def incidents(runtime: ServiceRuntime) -> list[str]:
    assert runtime.client is not None
    recorded, _ = await IncidentLog(runtime.client, runtime.keys).list()
    return [f"{r.kind} {r.instance_id}" for r in recorded]


async def test_the_beats_split_by_the_assignment_and_move_when_a_monitor_joins_or_leaves(
    etcd_settings: EtcdSettings,
) -> None:
    async with monitors(etcd_settings, "monitor-a", "monitor-b") as (a, b):
        senders = [sender(a, f"rollout-{i:02d}") for i in range(MEMBERS)]
        ids = {"monitor-a", "monitor-b"}

        async def assigned() -> bool:
            return all(
                s.connected.is_set() and s.monitor_id == owner(s.instance_id, ids) for s in senders
            )

        await eventually(assigned, timeout=10)

        async def watched() -> list[int]:
            return [len((await health(m)).members) for m in (a, b)]

        async def all_watched() -> bool:  # each monitor has a view once it took a first beat
            return sum(await watched()) == MEMBERS

        await eventually(all_watched, timeout=10)
        assert min(await watched()) > 0, await watched()
        assert sorted((await health(a)).monitors) == sorted(ids)

        c = await start_monitor(etcd_settings, "monitor-c")
        try:
            ids.add("monitor-c")
            await eventually(assigned, timeout=10)  # each moved on its old monitor's ack
            assert len((await health(c)).members) > 0
        finally:
            await c.shutdown()  # a clean stop: its lease is revoked, its key goes at once
        ids.discard("monitor-c")
        await eventually(assigned, timeout=10)
        await asyncio.sleep(1.0)  # five reconnect graces of the monitors they left
        assert await incidents(a) == []  # a move is no loss
        for s in senders:
            await s.stop()


async def test_a_failure_two_monitors_find_is_recorded_once(etcd_settings: EtcdSettings) -> None:
    client = await connect_etcd(etcd_settings)
    log = IncidentLog(client, KeySpace(etcd_settings.prefix))
    lease = await client.lease(60)
    lost = IncidentSubject(job_id="j", role="rollout", instance_id="r1", epoch=3)
    hung = IncidentSubject(job_id="j", role="rollout", instance_id="r2", epoch=3)
    first = new_incident(lost, "MEMBER_LOST", "stream ended", 0.9, 1.0)
    assert await log.record_once([(failure_mark(first, 0), first)], lease.id) == [first]
    # The other monitor finds the same failure (its hang, later its loss) and a new one.
    again = new_incident(lost, "ROLLOUT_HANG", "probe failed", 0.95, 2.0)
    other = new_incident(hung, "ROLLOUT_HANG", "probe failed", 0.95, 2.0)
    recorded = await log.record_once(
        [(failure_mark(again, 0), again), (failure_mark(other, 0), other)], lease.id
    )
    assert recorded == [other]
    listed, _ = await log.list()
    assert sorted((r.kind, r.instance_id) for r in listed) == [
        ("MEMBER_LOST", "r1"),
        ("ROLLOUT_HANG", "r2"),
    ]
    await client.close()


async def test_a_member_lost_while_its_monitor_is_gone_is_reported_by_the_other(
    etcd_settings: EtcdSettings,
) -> None:
    """The member's monitor stops; the member's lease then runs out without a goodbye: the
    monitor that owns it now reports it, once."""
    async with monitors(etcd_settings, "monitor-a", "monitor-b") as (a, b):
        assert a.client is not None
        ids = ["monitor-a", "monitor-b"]
        victim = next(
            f"rollout-{i}" for i in range(100) if owner(f"rollout-{i}", ids) == "monitor-a"
        )
        session = await Session.open(a.client, ttl=2)
        record = MemberRecord(
            role="rollout",
            instance_id=victim,
            address="127.0.0.1:9",
            pid=1,
            host="h",
            job_id="j",
            epoch=2,
        )
        await Registry(a.client, a.keys).register(session, record)
        beats = sender(a, victim)
        beats.progress.job_id, beats.progress.epoch = "j", 2
        await eventually(lambda: _connected_to(beats, "monitor-a"), timeout=10)
        await a.shutdown()
        await eventually(lambda: _connected_to(beats, "monitor-b"), timeout=10)
        # Now it dies: no goodbye, its lease is left to run out.
        assert beats._task is not None
        beats._task.cancel()
        await session.detach()
        await eventually(lambda: _has(b, f"MEMBER_LOST {victim}"), timeout=10)
        await asyncio.sleep(1.0)
        assert await incidents(b) == [f"MEMBER_LOST {victim}"]


async def _connected_to(beats: HeartbeatSender, monitor_id: str) -> bool:
    return beats.connected.is_set() and beats.monitor_id == monitor_id


async def _has(runtime: ServiceRuntime, incident: str) -> bool:
    return incident in await incidents(runtime)


async def test_health_pages_through_the_members_and_forgets_those_that_left(
    etcd_settings: EtcdSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(monitor_server, "PRUNE_INTERVAL", 0.2)
    runtime = await start_monitor(etcd_settings, "monitor-a", view_retention=0.5)
    try:
        senders = [sender(runtime, f"rollout-{i:02d}") for i in range(MEMBERS)]
        for s in senders:
            await asyncio.wait_for(s.connected.wait(), 10)

        async def all_alive() -> bool:
            return (await health(runtime)).counts.get("rollout/ALIVE", 0) == MEMBERS

        await eventually(all_alive, timeout=10)
        seen, token = [], ""
        while True:
            page = await health(runtime, page_size=5, page_token=token)
            assert len(page.members) <= 5
            seen += [m.instance_id for m in page.members]
            token = page.next_page_token
            if not token:
                break
        assert seen == sorted(s.instance_id for s in senders)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(runtime, page_size=5000)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        for s in senders:
            await s.stop()  # goodbyes: gone, never lost

        async def forgotten() -> bool:
            return dict((await health(runtime)).counts) == {}

        await eventually(forgotten, timeout=10)
        assert await incidents(runtime) == []
    finally:
        await runtime.shutdown()
