"""The Monitor gRPC service: heartbeat streams in, detector findings out as incidents."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.incidents import (
    IncidentRecord,
    episode_mark,
    failure_mark,
    new_incident,
    to_proto,
)
from robustrl.contracts.members import MemberRecord, member_rank
from robustrl.contracts.roles import ROLE_FROM_PROTO, ROLE_TO_PROTO
from robustrl.core.aio import cancel_and_wait
from robustrl.core.assignment import assignment_key, owner
from robustrl.core.channels import open_channel, refuses_connections
from robustrl.core.config import EtcdSettings
from robustrl.core.fences import FenceSet
from robustrl.core.incident_log import IncidentLog
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry, parse_member
from robustrl.core.runtime import ServiceRuntime
from robustrl.core.session import Session
from robustrl.core.watch import Delete, Put, Resync
from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.monitor import detectors, progress_detectors
from services.monitor.config import MonitorSettings
from services.monitor.incidents import from_finding
from services.monitor.memory import release_freed_memory

log = get_logger(__name__)

SERVICE_NAME = monitor_pb2.DESCRIPTOR.services_by_name["Monitor"].full_name


DEFAULT_HEALTH_PAGE = 500
MAX_HEALTH_PAGE = 1000
HEALTH_BUILT_PER_TURN = 100
"""Members GetHealth converts before it lets the event loop take beats again."""

PRUNE_INTERVAL = 5.0
"""Seconds between looks for members to forget (`MonitorSettings.view_retention`)."""

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
        self.monitors: set[str] = {runtime.instance_id}
        """The monitors registered now (this one always): the beats split between them."""
        self._marks: Session | None = None
        self._owners: dict[str, bool] = {}
        """Assignment key -> whether this monitor owns it, for the current `monitors`."""
        self._pruned_at = 0.0
        self._stopped = False

    @property
    def incident_log(self) -> IncidentLog:
        assert self.runtime.client is not None
        return IncidentLog(self.runtime.client, self.runtime.keys)

    async def start(self) -> None:
        assert self.runtime.client is not None
        self._marks = await Session.open(self.runtime.client, self.settings.incident_mark_ttl)
        self.fences = FenceSet(self.runtime.client, self.runtime.keys)
        self.fences.start()
        self._tasks = [
            asyncio.create_task(self._follow_registry(), name="follow-registry"),
            asyncio.create_task(self._evaluate_loop(), name="evaluate"),
        ]

    async def stop(self) -> None:
        self._stopped = True
        await cancel_and_wait(*self._tasks, *self._probes.values(), *self._checks)
        if self.fences is not None:
            await self.fences.stop()
        if self._marks is not None:
            # Not revoked: the marks must outlive this monitor, or the one that takes its
            # members over would report again what it reported. They expire with the lease.
            await self._marks.detach()

    def owns(self, view: detectors.MemberView) -> bool:
        """Whether this monitor watches the member (`assignment`): only the owner reports it."""
        key = assignment_key(view.role, view.instance_id, view.job_id)
        owned = self._owners.get(key)
        if owned is None:
            if len(self._owners) > 2 * len(self.views) + 64:
                self._owners.clear()  # keys of members long gone
            owned = self._owners[key] = owner(key, self.monitors) == self.runtime.instance_id
        return owned

    def _owned(self) -> list[detectors.MemberView]:
        return [view for view in self.views.values() if self.owns(view)]

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[monitor_pb2.Beat],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[monitor_pb2.BeatAck]:
        instance_id = ""
        answered: tuple[bool, bool] | None = None
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
                view = self.views[instance_id]
                moved = not beat.goodbye and not self.owns(view)
                # The first beat is answered, then only a beat whose answer changed: a member
                # acts on an ack only to stop or move, and an ack per beat cost both ends a
                # read and a write per beat (docs/decisions/0019).
                if (fenced, moved) != answered:
                    answered = (fenced, moved)
                    yield monitor_pb2.BeatAck(seq=beat.seq, fenced=fenced, moved=moved)
        finally:
            # Reached on a clean end, on a broken stream and on cancellation alike.
            if instance_id:
                self._stream_ended(instance_id, time.time())

    def _stream_ended(self, instance_id: str, now: float) -> None:
        if self._stopped:
            return  # this monitor is closing the streams itself
        view = self.views.get(instance_id)
        if view is not None and not self.owns(view):
            detectors.on_handed_over(self.views, instance_id)  # it beats to its owner now
            return
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
                if detectors.on_refused(self.views, instance_id, ended_at, address, time.time()):
                    log.info("monitor.refused", member=instance_id, address=address)
                    self._wake.set()
                return
            await asyncio.sleep(LISTEN_CHECK_RETRY)

    async def GetHealth(
        self, request: monitor_pb2.GetHealthRequest, context: grpc.aio.ServicerContext
    ) -> monitor_pb2.GetHealthResponse:
        if not 0 <= request.page_size <= MAX_HEALTH_PAGE:
            raise InvalidArgument(f"page_size must be in 0..{MAX_HEALTH_PAGE}")
        size = request.page_size or DEFAULT_HEALTH_PAGE
        watched = sorted(
            (v for v in self._owned() if not request.job_id or v.job_id == request.job_id),
            key=lambda v: v.instance_id,
        )
        counts: dict[str, int] = {}
        for view in watched:
            key = f"{view.role}/{view.state.value}"
            counts[key] = counts.get(key, 0) + 1
        start = bisect.bisect_right([v.instance_id for v in watched], request.page_token)
        page = watched[start : start + size]
        reply = monitor_pb2.GetHealthResponse(
            incidents_total=self.incidents_total,
            next_page_token=page[-1].instance_id if start + size < len(watched) else "",
            counts=counts,
            monitors=sorted(self.monitors),
        )
        for done, view in enumerate(page, 1):
            health = reply.members.add(
                role=ROLE_TO_PROTO[view.role],
                instance_id=view.instance_id,
                epoch=view.epoch,
                job_id=view.job_id,
                state=view.state.value,
                phase=view.phase,
            )
            health.last_seen.FromNanoseconds(int(view.last_seen * 1e9))
            health.counters.update(view.counters)
            if done % HEALTH_BUILT_PER_TURN == 0:
                await asyncio.sleep(0)  # the beats are taken on this loop: let them in
        return reply

    async def WatchIncidents(
        self, request: monitor_pb2.WatchIncidentsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.Incident]:
        if request.after_revision < 0:
            raise InvalidArgument("after_revision must be >= 0")
        async for record in self.incident_log.follow(request.job_id, request.after_revision):
            yield to_proto(record)

    def _registered(self, member: MemberRecord, now: float) -> None:
        if member.role == "monitor":
            # Monitors send no beats: one leaving is a change of the assignment, not a loss.
            self._monitors_changed(self.monitors | {member.instance_id})
            return
        detectors.on_registered(
            self.views,
            member.role,
            member.instance_id,
            member.epoch,
            now,
            member.address,
            member.job_id,
            member.lease_id,
            member_rank(member) or 0,
        )

    def _monitors_changed(self, monitors: set[str]) -> None:
        monitors.add(self.runtime.instance_id)
        if monitors == self.monitors:
            return
        log.info("monitor.monitors_changed", monitors=sorted(monitors))
        self.monitors = monitors
        self._owners.clear()
        for view in self.views.values():
            if not self.owns(view) and view.state is detectors.State.SUSPECT:
                # Its owner watches it now; what this monitor suspected is its owner's to judge.
                detectors.on_handed_over(self.views, view.instance_id)
        self._wake.set()  # members it owns now that were lost meanwhile are reported now

    async def _follow_registry(self) -> None:
        assert self.runtime.client is not None
        registry = Registry(self.runtime.client, self.runtime.keys)
        members, revision = await registry.list()
        self._monitors_changed({m.instance_id for m in members if m.role == "monitor"})
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
                role, instance_id = registry.role_and_instance(event.key)
                known.discard(instance_id)
                if role == "monitor":
                    self._monitors_changed(self.monitors - {instance_id})
                else:
                    self._unregistered(instance_id, now)
            elif isinstance(event, Resync):
                present = [parse_member(e) for e in event.entries]
                self._monitors_changed({m.instance_id for m in present if m.role == "monitor"})
                for instance_id in known - {m.instance_id for m in present}:
                    self._unregistered(instance_id, now)
                for member in present:
                    self._registered(member, now)
                known = {m.instance_id for m in present}

    def _unregistered(self, instance_id: str, now: float) -> None:
        beating = self.settings.silence_window
        if detectors.on_unregistered(self.views, instance_id, now, beating_within=beating):
            log.info("monitor.lease_lapsed_while_beating", member=instance_id)

    async def _evaluate_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.evaluate_interval)
            self._wake.clear()
            now = time.time()
            await self._evaluate(now)
            if now - self._pruned_at >= PRUNE_INTERVAL:
                self._prune(now)

    async def _evaluate(self, now: float) -> None:
        """One round over the members this monitor owns; what it finds is recorded in one go."""
        owned = self._owned()
        found: list[tuple[IncidentRecord, str, Callable[[], None]]] = []
        for finding in detectors.evaluate(owned, now, self.config):
            incident = from_finding(finding, finding.seen_at)
            found.append((incident, failure_mark(incident, finding.view.lease), _later(finding)))
        for progress in progress_detectors.evaluate(
            detectors.watched(owned), now, self.progress_config
        ):
            view = self.views[progress.instance_id]
            if progress.needs_probe:
                if progress.instance_id not in self._probes:
                    task = asyncio.create_task(self._probe(view, progress), name="probe")
                    self._probes[progress.instance_id] = task
                continue
            incident = new_incident(
                view, progress.kind, progress.evidence, progress.confidence, progress.seen_at or now
            ).model_copy(update={"job_id": progress.job_id, "rank": progress.rank})
            failure = progress.kind in progress_detectors.FAILURE_KINDS
            mark = (
                failure_mark(incident, view.lease)
                if failure
                else episode_mark(incident, progress.key)
            )
            found.append((incident, mark, _progress_later(view, progress, failure)))
        if found:
            await self._report(found)

    async def _report(self, found: list[tuple[IncidentRecord, str, Callable[[], None]]]) -> bool:
        """Record incidents in etcd, each unless another monitor recorded its failure already,
        then apply what each settles; False (all tried again next round) when etcd is away."""
        assert self._marks is not None
        try:
            recorded = await self.incident_log.record_once(
                [(mark, incident) for incident, mark, _ in found], self._marks.lease_id
            )
        except Exception as exc:
            log.warning("monitor.incident_unrecorded", error=repr(exc), incidents=len(found))
            return False
        for _, _, settle in found:
            settle()  # recorded here or by another monitor: reported either way
        ids = {r.incident_id for r in recorded}
        for incident, _, _ in found:
            if incident.incident_id not in ids:
                log.info(
                    "monitor.incident_recorded_elsewhere",
                    kind=incident.kind,
                    member=incident.instance_id,
                )
                continue
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

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        gone = detectors.forgettable(self.views, now, self.settings.view_retention)
        for instance_id in gone:
            del self.views[instance_id]
        if gone:
            self._owners.clear()  # its keys pin the allocator's pages from when they came
            log.info("monitor.views_forgotten", members=len(gone), left=len(self.views))
        release_freed_memory()

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
            incident = new_incident(view, kind, evidence, 0.95, time.time())
            # One failure, one incident: its lease running out later is the same failure.
            await self._report(
                [
                    (
                        incident,
                        failure_mark(incident, view.lease),
                        _progress_later(view, suspicion, failure=True),
                    )
                ]
            )
        finally:
            self._probes.pop(view.instance_id, None)

    async def _ask(self, view: detectors.MemberView) -> tuple[bool, str]:
        """(progressing, what was seen)."""
        assert self.runtime.registry is not None
        member = await self.runtime.registry.get(view.role, view.instance_id)
        address = member.address if member is not None else view.address
        if ":" not in address:
            return False, "not in the registry and never seen there"
        # Out of the registry is no proof of a hang: its lease may have lapsed while it lives
        # (an overloaded host, an etcd outage). The address it was last registered at answers.
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


def _later(finding: detectors.Finding) -> Callable[[], None]:
    return lambda: detectors.mark_reported([finding])


def _progress_later(
    view: detectors.MemberView, finding: progress_detectors.ProgressFinding, failure: bool
) -> Callable[[], None]:
    def settle() -> None:
        progress_detectors.mark_reported(view.progress(), finding)
        if failure:
            view.reported = True  # one failure, one incident: stop watching it

    return settle


async def serve(settings: MonitorSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime(
        "monitor", settings, etcd, service_names=[SERVICE_NAME], heartbeats=False
    )
    servicer = MonitorServicer(runtime, settings)
    monitor_pb2_grpc.add_MonitorServicer_to_server(servicer, runtime.host.server)
    await runtime.start()
    await servicer.start()
    # Detection stops before the server closes the streams: a monitor that stops must not
    # report the members it closes its streams on (they beat to another one now).
    runtime.host.before_stop.insert(0, servicer.stop)
    return runtime
