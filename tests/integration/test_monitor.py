"""Heartbeats in, incidents out, against a real monitor server and a real etcd."""

from __future__ import annotations

import asyncio

import grpc

from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc
from services.common.heartbeat import HeartbeatSender, Progress
from services.common.registry import Registry
from services.common.runtime import ServiceRuntime
from services.monitor.incidents import IncidentLog
from tests.support import eventually


async def health_state(api: monitor_pb2_grpc.MonitorStub, instance_id: str) -> str:
    reply = await api.GetHealth(monitor_pb2.GetHealthRequest(), timeout=5)
    for member in reply.members:
        if member.instance_id == instance_id:
            return str(member.state)
    return ""


async def test_a_clean_goodbye_is_never_an_incident(monitor: ServiceRuntime) -> None:
    assert monitor.client is not None
    sender = HeartbeatSender(
        Registry(monitor.client, monitor.keys),
        role=common_pb2.ROLE_ROLLOUT,
        instance_id="rollout-a",
        epoch=1,
        progress=Progress(phase="generate", job_id="j", counters={"tokens": 5.0}),
        interval=0.1,
    )
    sender.start()
    await asyncio.wait_for(sender.connected.wait(), 5)
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        api = monitor_pb2_grpc.MonitorStub(channel)

        async def alive() -> bool:
            return await health_state(api, "rollout-a") == "ALIVE"

        await eventually(alive, timeout=5)
        await sender.stop()

        async def gone() -> bool:
            return await health_state(api, "rollout-a") == "GONE"

        await eventually(gone, timeout=5)
        await asyncio.sleep(1.0)  # past the reconnect grace: still no incident
        reply = await api.GetHealth(monitor_pb2.GetHealthRequest(), timeout=5)
        assert reply.incidents_total == 0
    assert (await IncidentLog(monitor.client, monitor.keys).list())[0] == []


async def test_a_stream_that_dies_without_goodbye_raises_one_incident(
    monitor: ServiceRuntime,
) -> None:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        api = monitor_pb2_grpc.MonitorStub(channel)
        incidents = api.WatchIncidents(
            monitor_pb2.WatchIncidentsRequest(job_id="job-x"), timeout=15
        )
        await asyncio.sleep(0.2)  # the watch is established

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


async def test_malformed_beats_are_invalid_argument(monitor: ServiceRuntime) -> None:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()
        await call.write(monitor_pb2.Beat(role=common_pb2.ROLE_ROLLOUT))  # no instance id
        try:
            await call.read()
            raise AssertionError("expected an error")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
