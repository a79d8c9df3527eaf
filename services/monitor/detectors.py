"""What the monitor knows about each member, and the detectors — pure functions of (views, now).

A member is lost when its heartbeat stream ended without a goodbye and it did not come back
within the reconnect grace, or when its registry key vanished (lease expired) without a
goodbye while it was not beating either. A member that said goodbye is gone, never lost,
unless its goodbye beat still names a job: a clean stop of a member that serves a job loses the
job that member.

A stream that ended without a goodbye is also checked at once: when the member's own address
refuses connections, nothing listens there any more (the process died; a stopped or merely
cut-off process still has its listening socket), so it is lost without waiting out the grace.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.monitor.progress_detectors import Signals, observe


class State(enum.StrEnum):
    ALIVE = "ALIVE"
    SUSPECT = "SUSPECT"  # stream broke without goodbye; within the reconnect grace
    LOST = "LOST"
    GONE = "GONE"  # left with a goodbye


@dataclass
class MemberView:
    role: str
    instance_id: str
    epoch: int = 0
    job_id: str = ""
    rank: int = 0
    state: State = State.ALIVE
    last_seen: float = 0.0
    phase: str = ""
    counters: dict[str, float] = field(default_factory=dict)
    stream_open: bool = False
    registered: bool = False
    address: str = ""
    """host:port from its registry record (for the listening check), "" until it is seen."""
    goodbye: bool = False
    stream_ended_at: float | None = None
    evidence: str = ""
    reported: bool = False
    signals: Signals | None = None
    """Progress signals for the role-aware detectors (services/monitor/progress_detectors)."""
    lease: int = 0
    """The lease of its registry record (0 until seen): a new lease is a new incarnation."""
    lost_at: float | None = None
    """When a detector saw it lost (a refused address, its lease gone, a goodbye in a job)."""
    unregistered_at: float | None = None
    """When its registry record went (None while registered or never seen there)."""

    def progress(self) -> Signals:
        if self.signals is None:
            self.signals = Signals(role=self.role, instance_id=self.instance_id)
        return self.signals


@dataclass(frozen=True)
class Finding:
    """A detector's conclusion, before it becomes a recorded incident."""

    kind: str  # MEMBER_LOST, ...
    view: MemberView
    evidence: str
    confidence: float
    seen_at: float
    """When the failure became visible (its incident's detected_at), not when it was judged."""


@dataclass(frozen=True)
class DetectorConfig:
    reconnect_grace: float = 1.0


Views = dict[str, MemberView]


def _view(views: Views, role: str, instance_id: str) -> MemberView:
    view = views.get(instance_id)
    if view is None or view.state in (State.LOST, State.GONE):
        # A new incarnation (or a first sighting) starts with a clean slate.
        view = MemberView(role=role, instance_id=instance_id)
        views[instance_id] = view
    return view


def on_beat(
    views: Views,
    *,
    role: str,
    instance_id: str,
    epoch: int,
    job_id: str,
    rank: int,
    phase: str,
    counters: dict[str, float],
    goodbye: bool,
    now: float,
    phase_started_at: float = 0.0,
) -> MemberView:
    view = views.get(instance_id)
    if view is not None and view.state in (State.LOST, State.GONE) and _late(view, job_id, epoch):
        # A late beat from an instance already declared lost or gone revives nothing.
        return view
    view = _view(views, role, instance_id)
    view.epoch, view.job_id, view.rank = epoch, job_id, rank
    view.phase, view.counters = phase, dict(counters)
    view.last_seen = now
    view.stream_open = True
    view.stream_ended_at = None
    signals = view.progress()
    signals.job_id, signals.rank = job_id, rank
    observe(
        signals, phase=phase, phase_started_at=phase_started_at or now, counters=counters, now=now
    )
    if goodbye:
        view.goodbye = True
        if job_id:
            # A clean stop (SIGTERM: a pod deleted, a node drained, `robustrl down`) of a member
            # that still serves a job is that job's loss all the same; reported now instead of
            # when the leader finds it missing from the registry. Any rank of a trainer group:
            # the leader releases every rank when the job ends, before they may leave.
            view.state = State.LOST
            view.lost_at = now
            view.evidence = (
                f"stopped cleanly (a goodbye) while it still served job {job_id} at epoch {epoch}"
            )
        else:
            view.state = State.GONE
    elif view.state is State.SUSPECT:
        view.state = State.ALIVE
    return view


def _late(view: MemberView, job_id: str, epoch: int) -> bool:
    """Whether a sign of life comes from the binding `view` was declared lost or gone in: the
    same job at no higher epoch. Epochs count per job, so another job is a new incarnation
    whatever its epoch: a member lost while free and bound since (a partition that healed)
    would otherwise stay lost to the monitor, its hangs never reported."""
    return job_id == view.job_id and epoch <= view.epoch


def on_stream_end(views: Views, instance_id: str, now: float) -> None:
    view = views.get(instance_id)
    if view is None or view.state in (State.LOST, State.GONE):
        return
    view.stream_open = False
    if not view.goodbye:
        view.state = State.SUSPECT
        view.stream_ended_at = now


def on_handed_over(views: Views, instance_id: str) -> None:
    """The member's stream ended because it beats to another monitor now: nothing to suspect."""
    view = views.get(instance_id)
    if view is None:
        return
    view.stream_open = False
    if view.state is State.SUSPECT:
        view.state = State.ALIVE
    view.stream_ended_at = None


def on_refused(views: Views, instance_id: str, ended_at: float, address: str, now: float) -> bool:
    """The member's address refused a connection after its stream ended at `ended_at`: lost
    now, unless it reconnected (or ended again) since. True when this marked it lost."""
    view = views.get(instance_id)
    if view is None or view.state is not State.SUSPECT or view.stream_ended_at != ended_at:
        return False
    view.state = State.LOST
    view.lost_at = now
    view.evidence = (
        f"heartbeat stream ended without a goodbye and its address {address} refuses "
        "connections (nothing listens there: the process is gone)"
    )
    return True


def on_registered(
    views: Views,
    role: str,
    instance_id: str,
    epoch: int,
    now: float,
    address: str = "",
    job_id: str = "",
    lease: int = 0,
    rank: int = 0,
) -> None:
    view = views.get(instance_id)
    if view is not None and view.state is State.LOST and _late(view, job_id, epoch):
        return
    view = _view(views, role, instance_id)
    view.registered = True
    view.unregistered_at = None
    view.lease = lease or view.lease
    view.address = address or view.address
    view.epoch = max(view.epoch, epoch)
    signals = view.progress()
    signals.assigned_job, signals.assigned_rank = job_id, rank
    if not view.last_seen:
        view.last_seen = now


def on_unregistered(
    views: Views, instance_id: str, now: float, beating_within: float = 0.0
) -> bool:
    """The member's registry key is gone. Lost, unless it said goodbye (gone) or it is still
    beating: its stream is open and its last beat is at most `beating_within` seconds old.
    Then the lease lapsed while the member lives (etcd was unreachable for longer than the
    TTL, and every lease lapsed at once when it came back); it registers again by itself, and
    a member that freezes from here on is caught by the silence and hang detectors. True
    when it was kept alive for that reason."""
    view = views.get(instance_id)
    if view is None:
        return False
    view.registered = False
    view.unregistered_at = now
    if view.state in (State.LOST, State.GONE):
        return False
    if view.goodbye:
        view.state = State.GONE
        return False
    if view.stream_open and now - view.last_seen <= beating_within:
        return True
    view.state = State.LOST
    view.lost_at = now
    view.evidence = "registry lease expired (no refresh within the TTL) without a goodbye"
    return False


def evaluate(views: Iterable[MemberView], now: float, config: DetectorConfig) -> list[Finding]:
    """Findings not yet reported. Pure: `mark_reported` applies them once recorded."""
    findings: list[Finding] = []
    for view in views:
        if view.reported:
            continue
        if view.state is State.SUSPECT and view.stream_ended_at is not None:
            silent = now - view.stream_ended_at
            if silent >= config.reconnect_grace:
                evidence = (
                    f"heartbeat stream ended without a goodbye and no reconnect for {silent:.1f}s"
                )
                seen_at = view.stream_ended_at + config.reconnect_grace
                findings.append(Finding("MEMBER_LOST", view, evidence, 0.9, seen_at))
        elif view.state is State.LOST:
            seen_at = view.lost_at if view.lost_at is not None else now
            findings.append(Finding("MEMBER_LOST", view, view.evidence, 0.95, seen_at))
    return findings


def forgettable(views: Views, now: float, retention: float) -> list[str]:
    """Members out of the registry and off any stream of this monitor for `retention` seconds:
    nothing can be reported about them any more, and a monitor up for months must not keep
    every member it ever saw."""
    return [
        view.instance_id
        for view in views.values()
        if not view.registered
        and (not view.stream_open or view.state in (State.LOST, State.GONE))
        and now - max(view.last_seen, view.unregistered_at or 0.0) >= retention
    ]


def watched(views: Iterable[MemberView]) -> list[Signals]:
    """Members the progress detectors look at: alive, streaming, not already reported lost."""
    return [
        v.progress() for v in views if v.state is State.ALIVE and v.stream_open and not v.reported
    ]


def mark_reported(findings: list[Finding]) -> None:
    for finding in findings:
        finding.view.state = State.LOST
        finding.view.evidence = finding.evidence
        finding.view.reported = True
