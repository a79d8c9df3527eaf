"""Heartbeats in, incidents out, against a real monitor server and a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterable

import grpc
import pytest

from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings
from robustrl.core.fences import FenceRecord, write_fence
from robustrl.core.heartbeat import HeartbeatSender, Progress
from robustrl.core.incident_log import IncidentLog
from robustrl.core.registry import Registry
from robustrl.core.runtime import ServiceRuntime
from robustrl.core.session import Session
from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc
from services.monitor import detectors
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from tests.support import eventually


async def health_state(api: monitor_pb2_grpc.MonitorStub, instance_id: str) -> str:
    reply = await api.GetHealth(monitor_pb2.GetHealthRequest(), timeout=5)
    for member in reply.members:
        if member.instance_id == instance_id:
            return str(member.state)
    return ""


async def beating_rollout(
    monitor: ServiceRuntime, instance_id: str, *, job_id: str, epoch: int
) -> HeartbeatSender:
    """A rollout's heartbeat stream to `monitor`, connected, beating every 0.1 s."""
    assert monitor.client is not None
    sender = HeartbeatSender(
        Registry(monitor.client, monitor.keys),
        role=common_pb2.ROLE_ROLLOUT,
        instance_id=instance_id,
        progress=Progress(phase="generate", job_id=job_id, epoch=epoch, counters={"tokens": 5.0}),
        interval=0.1,
    )
    sender.start()
    await asyncio.wait_for(sender.connected.wait(), 5)
    return sender


def detector_rounds(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock (`now`) of each detector round the monitor in this process runs from here on."""
    rounds: list[float] = []
    evaluate = detectors.evaluate

    def counted(
        views: Iterable[detectors.MemberView], now: float, config: detectors.DetectorConfig
    ) -> list[detectors.Finding]:
        rounds.append(now)
        return evaluate(views, now, config)

    monkeypatch.setattr(detectors, "evaluate", counted)
    return rounds


async def evaluated_past(rounds: list[float], moment: float) -> None:
    """Until the monitor has finished a detector round at `moment` or later (its reports
    recorded): rounds run one after another, so the next one starting says that one is done."""

    async def finished() -> bool:
        return sum(now >= moment for now in rounds) >= 2

    await eventually(finished, timeout=10)


async def incidents_now(monitor: ServiceRuntime) -> int:
    """The incident log's revision now: a watch from it misses nothing recorded later,
    however long the watch takes to be established."""
    assert monitor.client is not None
    _, revision = await IncidentLog(monitor.client, monitor.keys).list()
    return revision


async def test_a_clean_goodbye_of_a_member_in_no_job_is_never_an_incident(
    monitor: ServiceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert monitor.client is not None
    rounds = detector_rounds(monkeypatch)
    sender = await beating_rollout(monitor, "rollout-a", job_id="", epoch=1)
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        api = monitor_pb2_grpc.MonitorStub(channel)

        async def alive() -> bool:
            return await health_state(api, "rollout-a") == "ALIVE"

        await eventually(alive, timeout=5)
        await sender.stop()

        async def gone() -> bool:
            return await health_state(api, "rollout-a") == "GONE"

        await eventually(gone, timeout=5)
        # The grace under test (0.5 s), twice over, as the monitor judged it: still no incident.
        await evaluated_past(rounds, time.time() + 1.0)
        reply = await api.GetHealth(monitor_pb2.GetHealthRequest(), timeout=5)
        assert reply.incidents_total == 0
    assert (await IncidentLog(monitor.client, monitor.keys).list())[0] == []


async def test_a_clean_goodbye_of_a_member_that_serves_a_job_is_its_loss_at_once(
    monitor: ServiceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM of a bound member (a pod deleted, a node drained): its job lost it all the same,
    reported on the goodbye rather than when the leader finds it missing from the registry."""
    assert monitor.client is not None
    rounds = detector_rounds(monkeypatch)
    sender = await beating_rollout(monitor, "rollout-b", job_id="job-g", epoch=2)
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        api = monitor_pb2_grpc.MonitorStub(channel)
        incidents = api.WatchIncidents(
            monitor_pb2.WatchIncidentsRequest(
                job_id="job-g", after_revision=await incidents_now(monitor)
            ),
            timeout=15,
        )
        await sender.stop()
        incident = await asyncio.wait_for(incidents.read(), 5)
        incidents.cancel()
    assert incident.kind == common_pb2.INCIDENT_KIND_MEMBER_LOST
    assert (incident.instance_id, incident.job_id, incident.epoch) == ("rollout-b", "job-g", 2)
    assert "stopped cleanly (a goodbye) while it still served job job-g" in incident.evidence
    # Three reconnect graces past the loss, as the monitor judged it: no second incident.
    await evaluated_past(rounds, time.time() + 1.5)
    recorded, _ = await IncidentLog(monitor.client, monitor.keys).list("job-g")
    assert [r.instance_id for r in recorded] == ["rollout-b"]


async def test_a_stream_that_dies_without_goodbye_raises_one_incident(
    monitor: ServiceRuntime,
) -> None:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        api = monitor_pb2_grpc.MonitorStub(channel)
        incidents = api.WatchIncidents(
            monitor_pb2.WatchIncidentsRequest(
                job_id="job-x", after_revision=await incidents_now(monitor)
            ),
            timeout=15,
        )

        doomed = grpc.aio.insecure_channel(monitor.address)
        call = monitor_pb2_grpc.MonitorStub(doomed).Heartbeat()
        await call.write(
            monitor_pb2.Beat(
                role=common_pb2.ROLE_TRAINER,
                instance_id="trainer-z",
                epoch=3,
                job_id="job-x",
                seq=1,
            )
        )
        await call.read()
        await doomed.close()  # the process "dies": the stream ends without a goodbye

        incident = await asyncio.wait_for(incidents.read(), 5)
        incidents.cancel()
        assert incident.kind == common_pb2.INCIDENT_KIND_MEMBER_LOST
        assert (incident.instance_id, incident.role) == ("trainer-z", common_pb2.ROLE_TRAINER)
        assert (incident.job_id, incident.epoch) == ("job-x", 3)
        assert "without a goodbye" in incident.evidence

        assert monitor.client is not None
        recorded, _ = await IncidentLog(monitor.client, monitor.keys).list("job-x")
        assert [r.instance_id for r in recorded] == ["trainer-z"]


async def beat_once_and_die(address: str, instance_id: str, job_id: str) -> None:
    """One beat on a heartbeat stream, then the stream ends without a goodbye."""
    channel = grpc.aio.insecure_channel(address)
    call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()
    await call.write(
        monitor_pb2.Beat(
            role=common_pb2.ROLE_TRAINER, instance_id=instance_id, epoch=1, job_id=job_id, seq=1
        )
    )
    await call.read()
    await channel.close()


async def test_a_broken_stream_whose_address_refuses_is_lost_before_the_grace(
    etcd_settings: EtcdSettings,
) -> None:
    monitor = await serve_monitor(
        MonitorSettings(instance_id="monitor-0", reconnect_grace=30.0), etcd_settings
    )
    listening = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens on dead_port any more
    assert monitor.client is not None
    session = await Session.open(monitor.client, ttl=30)
    try:
        registry = Registry(monitor.client, monitor.keys)
        for name, port in (
            ("trainer-dead", dead_port),
            ("trainer-away", listening.sockets[0].getsockname()[1]),
        ):
            address = f"127.0.0.1:{port}"
            record = MemberRecord(
                role="trainer", instance_id=name, address=address, pid=1, host="h"
            )
            await registry.register(session, record)
        async with grpc.aio.insecure_channel(monitor.address) as channel:
            api = monitor_pb2_grpc.MonitorStub(channel)
            incidents = api.WatchIncidents(
                monitor_pb2.WatchIncidentsRequest(
                    job_id="job-r", after_revision=await incidents_now(monitor)
                ),
                timeout=15,
            )

            async def both_known() -> bool:  # with the addresses of their registry records
                names = ("trainer-dead", "trainer-away")
                return all([await health_state(api, name) == "ALIVE" for name in names])

            await eventually(both_known, timeout=5)
            started = asyncio.get_running_loop().time()
            await beat_once_and_die(monitor.address, "trainer-dead", "job-r")
            await beat_once_and_die(monitor.address, "trainer-away", "job-r")
            incident = await asyncio.wait_for(incidents.read(), 5)
            took = asyncio.get_running_loop().time() - started
            assert incident.instance_id == "trainer-dead"
            assert f"127.0.0.1:{dead_port} refuses connections" in incident.evidence
            assert took < 5  # the grace is 30 s: only the refusal can have reported it
            # The member whose address still accepts (a stopped process, a cut stream) waits
            # out the grace: nothing about it within the next seconds.
            with contextlib.suppress(TimeoutError):
                more = await asyncio.wait_for(incidents.read(), 2.0)
                raise AssertionError(f"unexpected incident {more}")
            incidents.cancel()
            assert await health_state(api, "trainer-away") == "SUSPECT"
    finally:
        await session.close()
        listening.close()
        await monitor.shutdown()


async def test_malformed_beats_are_invalid_argument(monitor: ServiceRuntime) -> None:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()
        await call.write(monitor_pb2.Beat(role=common_pb2.ROLE_ROLLOUT))  # no instance id
        try:
            await call.read()
            raise AssertionError("expected an error")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT


async def first_ack(address: str, instance_id: str, job_id: str, epoch: int) -> monitor_pb2.BeatAck:
    """The answer to the first beat of a new stream (always answered); the stream then ends."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()
        beat = monitor_pb2.Beat(
            role=common_pb2.ROLE_ROLLOUT,
            instance_id=instance_id,
            job_id=job_id,
            epoch=epoch,
            seq=7,
        )
        await call.write(beat)
        ack = await call.read()
        assert ack.seq == 7
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK  # no further ack: the stream ended
        return ack


async def test_a_beat_is_told_fenced_only_at_or_below_the_fences_epoch(
    monitor: ServiceRuntime,
) -> None:
    """A fence names the epoch its instance served: beats of that binding (or older) hear
    `fenced`; the same id bound afresh at a higher epoch, or to another job, does not."""
    assert monitor.client is not None
    await write_fence(
        monitor.client,
        monitor.keys,
        FenceRecord(instance_id="rollout-f", job_id="j", epoch=2, reason="test"),
    )

    async def fenced(job_id: str, epoch: int) -> bool:
        return (await first_ack(monitor.address, "rollout-f", job_id, epoch)).fenced

    async def fenced_at_its_epoch() -> bool:
        return await fenced("j", 2)

    await eventually(fenced_at_its_epoch, timeout=5)  # once the monitor's watch has it
    assert await fenced("j", 1)
    assert not await fenced("j", 3)
    assert not await fenced("other-job", 2)


async def test_a_beat_is_answered_first_and_then_only_when_its_answer_changes(
    monitor: ServiceRuntime,
) -> None:
    """Beats 1 and 2 are not fenced, beat 3 is (an older epoch): the acks read are those of
    beats 1 and 3, so beat 2, whose answer was the same as beat 1's, had none."""
    assert monitor.client is not None
    await write_fence(
        monitor.client,
        monitor.keys,
        FenceRecord(instance_id="rollout-g", job_id="j", epoch=2, reason="test"),
    )

    async def known() -> bool:
        return (await first_ack(monitor.address, "rollout-g", "j", 2)).fenced

    await eventually(known, timeout=5)
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()

        async def beat(seq: int, epoch: int) -> None:
            await call.write(
                monitor_pb2.Beat(
                    role=common_pb2.ROLE_ROLLOUT,
                    instance_id="rollout-g",
                    job_id="j",
                    epoch=epoch,
                    seq=seq,
                )
            )

        await beat(1, 3)
        first = await call.read()
        await beat(2, 3)
        await beat(3, 1)
        second = await call.read()
        assert (first.seq, first.fenced) == (1, False)
        assert (second.seq, second.fenced) == (3, True)
        await call.done_writing()
