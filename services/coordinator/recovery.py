"""The recovery policy — a pure function of (incident, job state) -> actions.

Only the failed role is recovered; the living ones are left alone:

  rollout lost or hung      fence it, re-lease its open groups, ask for a replacement rollout
  trainer lost, hung,       fence every trainer rank of the job, restore from the last per-step
  stuck in a collective     checkpoint on a standby (or new) trainer; rollouts re-send what the
  or stopped on an error    trainer had not committed. An error that comes back at the same step
                            on the replacement is the job's, not a machine's: the job fails
                            (`trainer_error_recovered`)
  NaN/Inf                   roll back to the last good checkpoint and skip the batch; the same
                            rank again (others clean) marks its machine suspect: replace it
  degraded                  nothing (a warning for people)
  coordinator               nothing here: the standby replica wins the election and reloads

`recovery.mode: full_restart` answers every failure with a restart of every role from the last
checkpoint — the comparison baseline, never the default.

The executor (services/coordinator/driver.py) carries the actions out and records each one.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    epoch: int
    kind: str
    rank: int = 0
    step: int = 0


@dataclass(frozen=True)
class JobFacts:
    """What the policy needs from the job: who serves it now, at which epoch."""

    job_id: str
    running: bool
    mode: str
    members: dict[str, tuple[str, int]]
    """instance id -> (role, epoch) of every member serving the job now (trainer ranks too)."""
    nan_history: Sequence[int] = field(default_factory=tuple)
    """Ranks of the job's earlier NaN incidents, oldest first."""


def decide(incident: IncidentFacts, job: JobFacts) -> list[Action]:
    """The actions that recover from `incident`; [] when there is nothing to do (an old
    incarnation, a member no longer serving the job, a warning)."""
    if not job.running or incident.job_id != job.job_id:
        return []
    serving = job.members.get(incident.instance_id)
    if serving is None or serving[1] > incident.epoch:
        return []  # already replaced: the incident is about a fenced incarnation
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


def trainer_error_recovered(step: int, earlier: Sequence[int]) -> bool:
    """Whether a trainer's error at `step` (steps done) is recovered as a machine fault, on
    another trainer, given the steps of the job's earlier trainer errors (other trainers').

    A device that fails (an ECC or driver error, a full local disk) fails on one machine: the
    replacement trains past the step. An error in the job itself (its data, a reward that
    raises, a bug) fails every trainer at the same step: once a replacement stopped at or
    before a step where an earlier trainer stopped, it made no progress, and another
    replacement would fail the same way, so the job fails with the error instead."""
    return all(before < step for before in earlier)
