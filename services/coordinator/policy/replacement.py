"""Who is bound to a job: the members it starts on, which free member replaces a lost one and
in which order, which warm standbys are prepared for which job, and how many replacements
are asked of the provisioner. Pure: binding.py and asks.py carry the choices out."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from robustrl.contracts.members import MemberRecord
from robustrl.core.role_server import LEAVING_LABEL, PREPARED_LABEL
from services.coordinator.jobs import JobRecord, Phase

ROLES = ("trainer", "rollout")

ASKED_FOR_S = 120.0
"""A replacement asked of the provisioner counts as coming for this long: it is not asked for
again meanwhile, by this leader or (the time is stored in etcd) the next one."""


def is_standby(member: MemberRecord) -> bool:
    """A warm standby (trainer or rollout): it waits for a member of its role to fail instead
    of starting jobs."""
    return member.labels.get("standby") == "true"


def free_members(members: list[MemberRecord], role: str) -> list[MemberRecord]:
    """Members of `role` that a job may bind: in no job, not fenced, not about to exit."""
    return [
        m
        for m in members
        if m.role == role
        and not m.job_id
        and m.labels.get("fenced") != "true"
        and m.labels.get(LEAVING_LABEL) != "true"
    ]


def bindable(
    members: list[MemberRecord], fenced: Callable[[str], bool]
) -> tuple[dict[str, list[MemberRecord]], set[str]]:
    """Free trainers and rollouts (`free_members`) that may be bound to a job, and the ids of
    those passed over because `fenced` says their id is fenced from it. A fence names an
    instance id, and one bound under a fenced id (a process restarted in place with a fixed
    INSTANCE_ID, or a job id used again after a delete, whose fences stay) would be told it
    is fenced at its first beat and leave."""
    candidates = {role: free_members(members, role) for role in ROLES}
    barred = {
        m.instance_id for found in candidates.values() for m in found if fenced(m.instance_id)
    }
    free = {
        role: [m for m in found if m.instance_id not in barred]
        for role, found in candidates.items()
    }
    return free, barred


@dataclass(frozen=True)
class Start:
    """The members a pending job starts on (its trainers first, in rank order); none, and why
    it waits, while there are too few."""

    members: list[MemberRecord]
    waiting: str = ""
    ranks: dict[str, int] = field(default_factory=dict)
    """trainer instance id -> its rank in the job's group."""


def start_members(
    free: Mapping[str, list[MemberRecord]], replicas: int, trainers: int = 1
) -> Start:
    """A job starts on `trainers` free trainers (its group's ranks 0..trainers-1) and
    `replicas` free rollouts, the first of each found; standbys wait for a member of their
    role to fail."""
    found = [m for m in free["trainer"] if not is_standby(m)]
    rollouts = [m for m in free["rollout"] if not is_standby(m)]
    if len(found) < trainers or len(rollouts) < replicas:
        return Start(
            [],
            f"waiting for {trainers} free trainer{'s' if trainers > 1 else ''} and {replicas} "
            f"free rollouts (free now: {len(found)} trainers, {len(rollouts)} rollouts)",
        )
    group = found[:trainers]
    return Start([*group, *rollouts[:replicas]], ranks=group_ranks(group))


def group_ranks(trainers: Sequence[MemberRecord]) -> dict[str, int]:
    """Ranks 0..N-1 of a trainer group, in the order given."""
    return {m.instance_id: rank for rank, m in enumerate(trainers)}


def roles_missing(record: JobRecord, replicas: int, trainers: int = 1) -> list[str]:
    """The roles the job lost (recovery unbound them) and needs bound again: each trainer of
    its group (`trainers` ranks; recovery fences a group whole), then each rollout short of
    `replicas`. None for a record from before roles were kept: nothing to compare with."""
    if record.members and not record.member_roles:
        return []
    roles = list(record.member_roles.values())
    return ["trainer"] * max(0, trainers - roles.count("trainer")) + ["rollout"] * max(
        0, replicas - roles.count("rollout")
    )


def replacement_epoch(epoch: int, missing: Sequence[str]) -> int:
    """The epoch replacements are bound at: a new trainer comes with a new epoch."""
    return epoch + 1 if "trainer" in missing else epoch


def replacement_order(candidates: list[MemberRecord], job_id: str) -> list[MemberRecord]:
    """Free members in the order they replace a lost one: those prepared for this job first,
    warm standbys before the others among both (otherwise in the order found)."""
    return sorted(
        candidates,
        key=lambda m: (m.labels.get(PREPARED_LABEL) != job_id, not is_standby(m)),
    )


class Step(enum.Enum):
    """What the leader does with a free member it may bind as a replacement."""

    BIND = "bind"
    """Prepared for this job: bind it now."""
    PREPARE = "prepare"
    """Send it PREPARE; it counts as coming, and is bound once it answers."""
    AWAIT = "await"
    """A PREPARE for this job is under way: it counts as coming."""
    SKIP = "skip"
    """Busy building another job's model: try the next one."""


def replacement_step(member: MemberRecord, job_id: str, preparing_for: str | None) -> Step:
    """Only a member prepared for this job (label prepared=<job>) is bound. Any other is sent
    PREPARE first, in the background, and bound once it answers: a BIND that builds a model
    would hold the job's lock for seconds, and with it every lease, delivery and progress
    report of the job's living members. `preparing_for`: the job a PREPARE sent to it is
    building, None if none is under way."""
    if member.labels.get(PREPARED_LABEL) == job_id:
        return Step.BIND
    if preparing_for is None:
        return Step.PREPARE
    return Step.AWAIT if preparing_for == job_id else Step.SKIP


@dataclass(frozen=True)
class Filled:
    """The job record's change once replacements are bound."""

    change: dict[str, object]
    phase: Phase | None
    message: str


def filled(
    record: JobRecord,
    bound: list[MemberRecord],
    epoch: int,
    ranks: Mapping[str, int] | None = None,
) -> Filled:
    """The members bound join the job at `epoch` (trainers at their `ranks`); a job recovering
    its trainer group runs again once the group is bound."""
    roles = {**record.member_roles, **{m.instance_id: m.role for m in bound}}
    recovered = "trainer" in roles.values() and record.phase is Phase.RECOVERING
    change: dict[str, object] = {
        "members": [*record.members, *(m.instance_id for m in bound)],
        "member_roles": roles,
        "member_ranks": {**record.member_ranks, **(ranks or {})},
        "epoch": epoch,
    }
    if epoch > record.epoch:
        # A restored trainer starts from its checkpoint's version, which may be lower than the
        # last one reported: rollouts must not wait for the lost versions.
        change["weight_version"] = 0
    if recovered:
        return Filled(change, Phase.RUNNING, "running (recovered)")
    return Filled(change, None, record.message)


def standbys_to_prepare(
    running: list[str], members: list[MemberRecord], preparing: dict[str, str]
) -> list[tuple[MemberRecord, str]]:
    """(free standby, running job) pairs to send PREPARE to. A standby prepared for a running
    job (label), or with a PREPARE under way (`preparing`: instance -> job), is left alone;
    each of the others goes to the running job with the fewest standbys of its role so far."""
    if not running:
        return []
    chosen = []
    for role in ROLES:
        standbys = [m for m in free_members(members, role) if is_standby(m)]
        served = Counter({job: 0 for job in running})
        served.update(m.labels.get(PREPARED_LABEL, "") for m in standbys)
        served.update(preparing[m.instance_id] for m in standbys if m.instance_id in preparing)
        for member in standbys:
            if member.labels.get(PREPARED_LABEL) in running or member.instance_id in preparing:
                continue
            job_id = min(running, key=lambda j: served[j])
            served[job_id] += 1
            chosen.append((member, job_id))
    return chosen


def is_prepared_standby(member: MemberRecord) -> bool:
    """A free standby labelled as prepared for a job (which job: its PREPARED_LABEL)."""
    return is_standby(member) and not member.job_id and PREPARED_LABEL in member.labels


def prepared_standbys(
    known: Mapping[str, MemberRecord], members: list[MemberRecord], running: Sequence[str]
) -> dict[str, MemberRecord]:
    """Free standbys prepared for a running job, by instance id: those in the registry now,
    and those `known` from earlier rounds that left it since (a standby lost while prepared
    is fenced from the job and replaced when its incident comes). One that was bound, or whose
    job no longer runs, is dropped."""
    registered = {m.instance_id: m for m in members}
    held = {
        name: m
        for name, m in known.items()
        if name not in registered and m.labels.get(PREPARED_LABEL) in running
    }
    for m in members:
        if is_prepared_standby(m) and m.labels[PREPARED_LABEL] in running:
            held[m.instance_id] = m
    return held


def asks_due(asked: Sequence[float], count: int, now: float) -> tuple[list[float], int]:
    """Of `asked` (when replacements of a role were asked for), those still coming
    (ASKED_FOR_S), and how many more to ask for to have `count` coming."""
    coming = [t for t in asked if now - t < ASKED_FOR_S]
    return coming, max(0, count - len(coming))
