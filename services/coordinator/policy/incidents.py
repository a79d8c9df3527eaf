"""The actions that recover from an incident, the facts they are decided on, and the losses
the leader records itself because no monitor reported them. Pure: the caller reads the job
record, the registry and the incident log, and carries out what `decide` returns."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from robustrl.contracts.incidents import IncidentRecord, IncidentSubject
from robustrl.contracts.members import MemberRecord
from services.coordinator.jobs import JobRecord, Phase

FAILURES = frozenset(
    {"MEMBER_LOST", "ROLLOUT_HANG", "TRAINER_HANG", "COLLECTIVE_HANG", "TRAINER_ERROR"}
)

NAN_SUSPECT_REPEATS = 2
"""NaN on the same rank this many times, with the other ranks clean, marks its machine."""


class Do(enum.StrEnum):
    FENCE = "FENCE"
    REQUEUE = "REQUEUE"
    REPLACE_ROLLOUT = "REPLACE_ROLLOUT"
    RESTORE_TRAINER = "RESTORE_TRAINER"
    ROLLBACK = "ROLLBACK"
    FULL_RESTART = "FULL_RESTART"


@dataclass(frozen=True)
class Action:
    do: Do
    instance_id: str = ""
    reason: str = ""


@dataclass(frozen=True)
class IncidentFacts:
    """What the policy needs from an incident."""

    incident_id: str
    job_id: str
    role: str
    instance_id: str
    epoch: int | None
    """The binding epoch the reporter saw the member serve the job at; None where unknown."""
    kind: str
    rank: int = 0
    step: int = 0


@dataclass(frozen=True)
class JobFacts:
    """What the policy needs from the job: who serves it now, at which epoch."""

    job_id: str
    running: bool
    mode: str
    members: Mapping[str, tuple[str, int | None]]
    """instance id -> (role, epoch) of every member serving the job now. The epoch is the one
    the member's registry record shows it bound to this job at; None where the registry does
    not show it serving the job (gone, or its name taken by a new process)."""
    nan_history: Sequence[int] = field(default_factory=tuple)
    """Ranks of the job's earlier NaN incidents, oldest first."""


def decide(incident: IncidentFacts, job: JobFacts) -> list[Action]:
    """The actions that recover from `incident`; [] when there is nothing to do (an earlier
    binding of a member that serves the job again, a member no longer serving it, a
    warning)."""
    if not job.running or incident.job_id != job.job_id:
        return []
    serving = job.members.get(incident.instance_id)
    if serving is None or _earlier_binding(incident.epoch, serving[1]):
        return []
    failed = incident.kind in FAILURES
    if incident.kind == "NON_FINITE":
        return _nonfinite(incident, job)
    if not failed:
        return []
    why = f"{incident.kind} {incident.incident_id}"
    if job.mode == "full_restart":
        return [Action(Do.FULL_RESTART, reason=why)]
    if incident.role == "rollout":
        return [
            Action(Do.FENCE, incident.instance_id, why),
            Action(Do.REQUEUE, incident.instance_id, why),
            Action(Do.REPLACE_ROLLOUT, incident.instance_id, why),
        ]
    if incident.role == "trainer":
        ranks = sorted(i for i, (role, _) in job.members.items() if role == "trainer")
        return [
            *(Action(Do.FENCE, i, why) for i in ranks),
            Action(Do.RESTORE_TRAINER, incident.instance_id, why),
        ]
    return []


def _earlier_binding(reported: int | None, serving: int | None) -> bool:
    """Whether the member serves the job at a higher epoch than the incident saw: it was let go
    without a fence (a full restart releases every member but the failed one) and bound
    again, and the incident is about the process that served before. Where either epoch is
    unknown, membership alone decides."""
    return reported is not None and serving is not None and serving > reported


def _nonfinite(incident: IncidentFacts, job: JobFacts) -> list[Action]:
    why = f"NON_FINITE {incident.incident_id} at step {incident.step}"
    if job.mode == "full_restart":
        return [Action(Do.FULL_RESTART, reason=why)]
    history = [*job.nan_history, incident.rank]
    repeats = sum(1 for r in history if r == incident.rank)
    others = {r for r in history if r != incident.rank}
    if repeats >= NAN_SUSPECT_REPEATS and not others:
        suspect = f"{why}: rank {incident.rank} produced NaN {repeats} times, other ranks clean"
        ranks = sorted(i for i, (role, _) in job.members.items() if role == "trainer")
        if len(ranks) > 1:
            # Only a rank among others can be told apart from the data: replace its machine.
            return [
                *(Action(Do.FENCE, i, suspect) for i in ranks),
                Action(Do.RESTORE_TRAINER, incident.instance_id, suspect),
            ]
    return [Action(Do.ROLLBACK, incident.instance_id, why)]


def serving_epochs(record: JobRecord, registered: Iterable[MemberRecord]) -> dict[str, int]:
    """Member -> the epoch its registry record shows it bound to the job at, for the job's
    members registered as members of this job (epochs count per job)."""
    return {
        m.instance_id: m.epoch
        for m in registered
        if m.job_id == record.job_id and m.instance_id in record.member_roles
    }


def facts(
    record: JobRecord,
    mode: str,
    nan_history: Sequence[int],
    registered: Iterable[MemberRecord] = (),
) -> JobFacts:
    """The job as `decide` sees it: its members with the epochs `registered` (the registry's
    records) shows them serving at."""
    epochs = serving_epochs(record, registered)
    return JobFacts(
        job_id=record.job_id,
        running=record.phase in (Phase.RUNNING, Phase.RECOVERING),
        mode=mode,
        members={i: (role, epochs.get(i)) for i, role in record.member_roles.items()},
        nan_history=tuple(nan_history),
    )


def incident_facts(record: JobRecord, incident: IncidentRecord) -> IncidentFacts:
    """The incident as `decide` sees it, at the job's step. Every rank of a trainer group is a
    member of the job: an incident about any of them fails the whole group (`decide`)."""
    return IncidentFacts(
        incident_id=incident.incident_id,
        job_id=incident.job_id,
        role=incident.role,
        instance_id=incident.instance_id,
        epoch=incident.epoch,
        kind=incident.kind,
        rank=incident.rank,
        step=record.step,
    )


def leader_subject(record: JobRecord, instance_id: str) -> IncidentSubject:
    """Whom an incident the leader finds itself (not the monitor) is about: a member of
    `record`, at the job's epoch. No member serves the job at
    a higher one, so such an incident is never taken for one about an earlier binding."""
    return IncidentSubject(
        role=record.member_roles.get(instance_id, "trainer"),
        instance_id=instance_id,
        epoch=record.epoch,
        job_id=record.job_id,
    )


def missing_members(
    record: JobRecord,
    members: list[MemberRecord],
    missing: dict[tuple[str, str], float],
    now: float,
) -> list[tuple[str, float]]:
    """The job's bound members missing from the registry, each with since when (kept in
    `missing`, which forgets a member once it is registered again or no longer bound).

    Registered means registered as a member of this job: a record under the same name but of no
    job or another is a new process that took the name (the whole local stack stopped and
    started again, a pod replaced under a fixed name), and the job's member is as gone as if
    nothing were there."""
    registered = {m.instance_id for m in members if m.job_id == record.job_id}
    bound = {(record.job_id, i) for i in record.member_roles if i not in registered}
    for key in [k for k in missing if k[0] == record.job_id and k not in bound]:
        del missing[key]
    for key in bound:
        missing.setdefault(key, now)
    return sorted((i, missing[(job, i)]) for job, i in bound)


@dataclass(frozen=True)
class UnreportedLoss:
    """A bound member the leader records as lost (a MEMBER_LOST incident) itself."""

    instance_id: str
    role: str
    evidence: str


def unreported_losses(
    record: JobRecord,
    members: list[MemberRecord],
    missing: dict[tuple[str, str], float],
    now: float,
    after: float,
) -> list[UnreportedLoss]:
    """The job's bound members missing from the registry (`missing_members`) for `after`
    seconds. The monitor reports a loss within the session TTL, and recovery then unbinds the
    member; a member still bound and missing after that failed while no monitor ran (a
    monitor that restarts lists only the registered members: it never saw it go)."""
    losses = []
    for instance_id, since in missing_members(record, members, missing, now):
        if now - since < after:
            continue
        other = next((m for m in members if m.instance_id == instance_id), None)
        where = (
            "missing from the registry"
            if other is None
            else f"registered again as a member of {other.job_id or 'no job'} (a new process)"
        )
        evidence = (
            f"bound to job {record.job_id} but {where} for {now - since:.0f}s, "
            "and no monitor reported it"
        )
        losses.append(UnreportedLoss(instance_id, record.member_roles[instance_id], evidence))
    return losses
