"""The Monitor gRPC service: heartbeat streams in, detector findings out as incidents."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc
from services.common.aio import cancel_and_wait
from services.common.config import EtcdSettings
from services.common.errors import InvalidArgument
from services.common.logs import get_logger
from services.common.registry import ROLE_FROM_PROTO, ROLE_TO_PROTO, Registry, parse_member
from services.common.runtime import ServiceRuntime
from services.common.watch import Delete, Put, Resync
from services.monitor import detectors
from services.monitor.config import MonitorSettings
from services.monitor.incidents import IncidentLog, from_finding, to_proto

log = get_logger(__name__)

SERVICE_NAME = monitor_pb2.DESCRIPTOR.services_by_name["Monitor"].full_name


class MonitorServicer(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, runtime: ServiceRuntime, settings: MonitorSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.views: detectors.Views = {}
        self.config = detectors.DetectorConfig(reconnect_grace=settings.reconnect_grace)
        self.incidents_total = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def incident_log(self) -> IncidentLog:
        assert self.runtime.client is not None
        return IncidentLog(self.runtime.client, self.runtime.keys)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow_registry(), name="follow-registry"),
            asyncio.create_task(self._evaluate_loop(), name="evaluate"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[monitor_pb2.Beat],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[monitor_pb2.BeatAck]:
        instance_id = ""
        try:
            async for beat in request_iterator:
                if not beat.instance_id or beat.role not in ROLE_FROM_PROTO:
                    raise InvalidArgument("a beat needs instance_id and a role")
                if instance_id and beat.instance_id != instance_id:
                    raise InvalidArgument("one heartbeat stream carries one instance")
                instance_id = beat.instance_id
                detectors.on_beat(
                    self.views,
                    role=ROLE_FROM_PROTO[beat.role],
                    instance_id=beat.instance_id,
                    epoch=beat.epoch,
                    job_id=beat.job_id,
                    rank=beat.rank,
                    phase=beat.phase,
                    counters=dict(beat.counters),
                    goodbye=beat.goodbye,
                    now=time.time(),
                )
                if beat.goodbye:
                    log.info("monitor.goodbye", member=instance_id)
                yield monitor_pb2.BeatAck(seq=beat.seq)
        finally:
            # Reached on a clean end, on a broken stream and on cancellation alike.
            if instance_id:
                detectors.on_stream_end(self.views, instance_id, time.time())

    async def GetHealth(
        self, request: monitor_pb2.GetHealthRequest, context: grpc.aio.ServicerContext
    ) -> monitor_pb2.GetHealthResponse:
        members = []
        for view in self.views.values():
            if request.job_id and view.job_id != request.job_id:
                continue
            health = monitor_pb2.MemberHealth(
                role=ROLE_TO_PROTO[view.role],
                instance_id=view.instance_id,
                epoch=view.epoch,
                job_id=view.job_id,
                state=view.state.value,
                phase=view.phase,
            )
            health.last_seen.FromNanoseconds(int(view.last_seen * 1e9))
            health.counters.update(view.counters)
            members.append(health)
        return monitor_pb2.GetHealthResponse(members=members, incidents_total=self.incidents_total)

    async def WatchIncidents(
        self, request: monitor_pb2.WatchIncidentsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.Incident]:
        if request.after_revision < 0:
            raise InvalidArgument("after_revision must be >= 0")
        async for record in self.incident_log.follow(request.job_id, request.after_revision):
            yield to_proto(record)

    async def _follow_registry(self) -> None:
        assert self.runtime.client is not None
        registry = Registry(self.runtime.client, self.runtime.keys)
        members, revision = await registry.list()
        for m in members:
            detectors.on_registered(self.views, m.role, m.instance_id, m.epoch, time.time())
        known = {m.instance_id for m in members}
        async for event in registry.watch(revision + 1):
            now = time.time()
            if isinstance(event, Put):
                member = parse_member(event.entry)
                known.add(member.instance_id)
                detectors.on_registered(
                    self.views, member.role, member.instance_id, member.epoch, now
                )
            elif isinstance(event, Delete):
                _, instance_id = registry.role_and_instance(event.key)
                known.discard(instance_id)
                detectors.on_unregistered(self.views, instance_id, now)
            elif isinstance(event, Resync):
                present = {parse_member(e).instance_id for e in event.entries}
                for instance_id in known - present:
                    detectors.on_unregistered(self.views, instance_id, now)
                known = present

    async def _evaluate_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.evaluate_interval)
            now = time.time()
            findings = [
                f
                for f in detectors.evaluate(self.views, now, self.config)
                if f.view.instance_id != self.runtime.instance_id
            ]
            for finding in findings:
                incident = from_finding(finding, now)
                try:
                    await self.incident_log.record(incident)
                except Exception as exc:  # etcd away: report again on the next round
                    log.warning("monitor.incident_unrecorded", error=repr(exc))
                    continue
                detectors.mark_reported([finding])
                self.incidents_total += 1
                log.warning(
                    "monitor.incident",
                    kind=incident.kind,
                    member=incident.instance_id,
                    role=incident.role,
                    job=incident.job_id,
                    evidence=incident.evidence,
                )


async def serve(settings: MonitorSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime(
        "monitor", settings, etcd, service_names=[SERVICE_NAME], heartbeats=False
    )
    servicer = MonitorServicer(runtime, settings)
    monitor_pb2_grpc.add_MonitorServicer_to_server(servicer, runtime.host.server)
    await runtime.start()
    servicer.start()
    runtime.host.after_stop.insert(0, servicer.stop)
    return runtime
