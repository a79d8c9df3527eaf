"""The Monitor gRPC service: heartbeat streams in, detector findings out as incidents."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.incidents import IncidentRecord, new_incident, to_proto
from robustrl.contracts.members import MemberRecord
from robustrl.contracts.roles import ROLE_FROM_PROTO, ROLE_TO_PROTO
from robustrl.core.aio import cancel_and_wait
from robustrl.core.channels import open_channel, refuses_connections
from robustrl.core.config import EtcdSettings
from robustrl.core.fences import FenceSet
from robustrl.core.incident_log import IncidentLog
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry, parse_member
from robustrl.core.runtime import ServiceRuntime
from robustrl.core.watch import Delete, Put, Resync
from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.monitor import detectors, progress_detectors
from services.monitor.config import MonitorSettings
from services.monitor.incidents import from_finding

log = get_logger(__name__)

SERVICE_NAME = monitor_pb2.DESCRIPTOR.services_by_name["Monitor"].full_name


LISTEN_CHECK_RETRY = 0.05
"""Seconds between connection attempts to a member whose stream broke (_check_listening)."""


class MonitorServicer(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, runtime: ServiceRuntime, settings: MonitorSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.views: detectors.Views = {}
        self.config = detectors.DetectorConfig(reconnect_grace=settings.reconnect_grace)
        self.progress_config = settings.progress_config()
        self.incidents_total = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._checks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.fences: FenceSet | None = None

    @property
    def incident_log(self) -> IncidentLog:
        assert self.runtime.client is not None
        return IncidentLog(self.runtime.client, self.runtime.keys)

    def start(self) -> None:
        assert self.runtime.client is not None
        self.fences = FenceSet(self.runtime.client, self.runtime.keys)
        self.fences.start()
        self._tasks = [
            asyncio.create_task(self._follow_registry(), name="follow-registry"),
            asyncio.create_task(self._evaluate_loop(), name="evaluate"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, *self._probes.values(), *self._checks)
        if self.fences is not None:
            await self.fences.stop()

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
                before = self.views.get(instance_id)
                nonfinite_before = [
                    before.counters.get(n, 0.0) if before else 0.0
                    for n in progress_detectors.NONFINITE_COUNTERS
                ]
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
                    phase_started_at=(
                        beat.phase_started_at.ToNanoseconds() / 1e9
                        if beat.HasField("phase_started_at")
                        else 0.0
                    ),
                )
                nonfinite_now = [
                    beat.counters.get(n, 0.0) for n in progress_detectors.NONFINITE_COUNTERS
                ]
                if any(n > b for n, b in zip(nonfinite_now, nonfinite_before, strict=True)):
                    self._wake.set()  # a new NaN is reported in its step, not at the next round
                if beat.goodbye:
                    log.info("monitor.goodbye", member=instance_id, job=beat.job_id)
                    self._wake.set()  # a member that left its job is reported now
                fenced = self.fences is not None and self.fences.fences(
                    beat.instance_id, beat.job_id, beat.epoch
                )
                yield monitor_pb2.BeatAck(seq=beat.seq, fenced=fenced)
        finally:
            # Reached on a clean end, on a broken stream and on cancellation alike.
            if instance_id:
                self._stream_ended(instance_id, time.time())

    def _stream_ended(self, instance_id: str, now: float) -> None:
        detectors.on_stream_end(self.views, instance_id, now)
        view = self.views.get(instance_id)
        if view is None or view.state is not detectors.State.SUSPECT:
            return
        task = asyncio.create_task(
            self._check_listening(instance_id, view.address, now), name="check-listening"
        )
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check_listening(self, instance_id: str, address: str, ended_at: float) -> None:
        """Connect, for a short while, to the address (from the registry records the monitor
        follows) of a member whose stream just broke: a refusal means the process is gone, and
        it is reported now instead of after the reconnect grace. A dying process may still
        hold its listening socket for a moment after its streams closed, so an accepted
        connection is tried again."""
        if ":" not in address:
            return  # never seen in the registry (or no server): the grace decides
        deadline = time.monotonic() + self.settings.listen_check_window
        while time.monotonic() < deadline:
            view = self.views.get(instance_id)
            if view is None or view.stream_ended_at != ended_at:
                return  # reconnected, ended again or reported: this check is over
            refused = await refuses_connections(address, max(0.01, deadline - time.monotonic()))
            if refused is None:
                # Unreachable or slow is no proof of death (a cut link, a stopped process):
                # the reconnect grace and the lease decide.
                log.debug("monitor.listen_check_inconclusive", member=instance_id)
                return
            if refused:
                if detectors.on_refused(self.views, instance_id, ended_at, address):
                    log.info("monitor.refused", member=instance_id, address=address)
                    self._wake.set()
                return
            await asyncio.sleep(LISTEN_CHECK_RETRY)

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

    def _registered(self, member: MemberRecord, now: float) -> None:
        detectors.on_registered(
            self.views,
            member.role,
            member.instance_id,
            member.epoch,
            now,
            member.address,
            member.job_id,
        )

    async def _follow_registry(self) -> None:
        assert self.runtime.client is not None
        registry = Registry(self.runtime.client, self.runtime.keys)
        members, revision = await registry.list()
        for m in members:
            self._registered(m, time.time())
        known = {m.instance_id for m in members}
        async for event in registry.watch(revision + 1):
            now = time.time()
            if isinstance(event, Put):
                member = parse_member(event.entry)
                known.add(member.instance_id)
                self._registered(member, now)
            elif isinstance(event, Delete):
                _, instance_id = registry.role_and_instance(event.key)
                known.discard(instance_id)
                self._unregistered(instance_id, now)
            elif isinstance(event, Resync):
                present = {parse_member(e).instance_id for e in event.entries}
                for instance_id in known - present:
                    self._unregistered(instance_id, now)
                known = present

    def _unregistered(self, instance_id: str, now: float) -> None:
        beating = self.settings.silence_window
        if detectors.on_unregistered(self.views, instance_id, now, beating_within=beating):
            log.info("monitor.lease_lapsed_while_beating", member=instance_id)

    async def _evaluate_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.evaluate_interval)
            self._wake.clear()
            await self._evaluate(time.time())

    async def _evaluate(self, now: float) -> None:
        for finding in detectors.evaluate(self.views, now, self.config):
            if finding.view.instance_id == self.runtime.instance_id:
                continue
            if await self._report(from_finding(finding, now)):
                detectors.mark_reported([finding])
        for progress in progress_detectors.evaluate(
            detectors.watched(self.views), now, self.progress_config
        ):
            view = self.views[progress.instance_id]
            if progress.needs_probe:
                if progress.instance_id not in self._probes:
                    task = asyncio.create_task(self._probe(view, progress), name="probe")
                    self._probes[progress.instance_id] = task
                continue
            if await self._report(
                new_incident(view, progress.kind, progress.evidence, progress.confidence, now)
            ):
                progress_detectors.mark_reported(view.progress(), progress)
                if progress.kind in progress_detectors.FAILURE_KINDS:
                    view.reported = True  # one failure, one incident: stop watching it

    async def _report(self, incident: IncidentRecord) -> bool:
        """Record an incident in etcd; False (try again next round) when etcd is away."""
        try:
            await self.incident_log.record(incident)
        except Exception as exc:
            log.warning("monitor.incident_unrecorded", error=repr(exc))
            return False
        self.incidents_total += 1
        log.warning(
            "monitor.incident",
            kind=incident.kind,
            member=incident.instance_id,
            role=incident.role,
            rank=incident.rank,
            job=incident.job_id,
            evidence=incident.evidence,
        )
        return True

    async def _probe(
        self, view: detectors.MemberView, suspicion: progress_detectors.ProgressFinding
    ) -> None:
        """Ask a suspect member, with a deadline, whether it is making progress. Only a
        failed probe becomes a hang incident; an answer that shows progress clears it."""
        try:
            started = time.time()
            answered, detail = await self._ask(view)
            signals = view.progress()
            if answered:
                log.info("monitor.probe_cleared", member=view.instance_id, detail=detail)
                progress_detectors.mark_reported(signals, suspicion)
                return
            if view.reported or view.state is not detectors.State.ALIVE:
                return  # already reported lost (its lease expired meanwhile)
            kind = {"rollout": "ROLLOUT_HANG", "trainer": "TRAINER_HANG"}.get(
                view.role, "MEMBER_LOST"
            )
            evidence = f"{suspicion.evidence}; probe after {time.time() - started:.1f}s: {detail}"
            if await self._report(new_incident(view, kind, evidence, 0.95, time.time())):
                progress_detectors.mark_reported(signals, suspicion)
                # One failure, one incident: its lease running out later is the same failure.
                view.reported = True
        finally:
            self._probes.pop(view.instance_id, None)

    async def _ask(self, view: detectors.MemberView) -> tuple[bool, str]:
        """(progressing, what was seen)."""
        assert self.runtime.registry is not None
        member = await self.runtime.registry.get(view.role, view.instance_id)
        if member is None:
            return False, "not in the registry"
        address = member.address
        wait = self.settings.probe_wait if view.role == "rollout" else 0.0
        timeout = wait + self.settings.probe_deadline
        try:
            async with open_channel(address) as channel:
                if view.role == "rollout":
                    reply = await rollout_pb2_grpc.RolloutStub(channel).Probe(
                        rollout_pb2.ProbeRequest(wait_s=wait), timeout=timeout
                    )
                    return reply.progressing, reply.detail or "answered"
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout
                )
                return (
                    True,
                    f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}",
                )
        except grpc.aio.AioRpcError as exc:
            return False, f"no answer within {timeout:.1f}s ({exc.code().name})"


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
