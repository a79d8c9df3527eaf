"""When a failure is the job's own and the job fails instead of being recovered: poison
groups, a trainer's error that comes back on its replacement, a rollout's error. Pure."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.jobspec import RecoverySpec


def poison_group(losses: int, max_losses: int) -> bool:
    """Whether a prompt group that has lost `losses` holders while out to them is a poison
    group (it takes down whatever generates it) and is dropped instead of leased again;
    `max_losses` 0: never (`recovery.group_losses`)."""
    return bool(max_losses) and losses >= max_losses


def leased_alone(group: str, lost_before: Container[str]) -> bool:
    """Whether `group` is leased alone: it lost a holder before, and the groups leased beside
    it must not share the blame for its next loss."""
    return group in lost_before


def poison_verdict(job_id: str, recovery: RecoverySpec, poisoned: int) -> str:
    """Why the job fails, once `recovery.poison_groups` of its groups were dropped as poison
    groups; empty until then (and always, with no limit)."""
    if not recovery.poison_groups or poisoned < recovery.poison_groups:
        return ""
    return (
        f"{poisoned} prompt groups were dropped as poison groups (each took down "
        f"{recovery.group_losses} rollouts that generated it; recovery.poison_groups is "
        f"{recovery.poison_groups}): what takes down the rollouts is the job's own "
        f"(its model, engine or data), not a machine's; `robustrl dropped {job_id}` lists them"
    )


def trainer_error_recovered(step: int, earlier: Sequence[int]) -> bool:
    """Whether a trainer's error at `step` (steps done) is recovered as a machine fault, on
    another trainer, given the steps of the job's earlier trainer errors (other trainers').

    A device that fails (an ECC or driver error, a full local disk) fails on one machine: the
    replacement trains past the step. An error in the job itself (its data, a reward that
    raises, a bug) fails every trainer at the same step: once a replacement stopped at or
    before a step where an earlier trainer stopped, it made no progress, and another
    replacement would fail the same way, so the job fails with the error instead."""
    return all(before < step for before in earlier)


@dataclass(frozen=True)
class ErrorVerdict:
    """What a member's reported error leads to: the job fails (`fail` says why), it is
    recovered (`recover`: recorded as an incident and recovered as a lost member), or
    neither (the same report again)."""

    fail: str = ""
    recover: bool = False


def trainer_error_verdict(
    instance_id: str,
    error: str,
    *,
    in_job: bool,
    step: int,
    epoch: int,
    earlier: Sequence[IncidentRecord],
) -> ErrorVerdict:
    """A trainer stopped at `step` on `error`, while the job is at `epoch`; `earlier`: the
    job's TRAINER_ERROR incidents so far. An error the trainer found in the job itself fails
    it. Any other, the first time at a step, is recovered as a lost trainer (another trainer
    restores the last checkpoint); the same error again before any progress fails the job
    (`trainer_error_recovered`). A report sent again changes nothing."""
    message = f"trainer {instance_id}: {error}"
    if in_job:
        return ErrorVerdict(fail=message)
    if any(i.instance_id == instance_id and i.epoch == epoch for i in earlier):
        return ErrorVerdict()  # recorded already: the trainer sent its report again
    if not trainer_error_recovered(step, [i.step for i in earlier]):
        before = max(i.step for i in earlier)
        return ErrorVerdict(
            fail=f"{message} (at step {step}, after a trainer that stopped at step {before} was "
            "replaced: the error is the job's, not a machine's)"
        )
    return ErrorVerdict(recover=True)


def rollout_error_verdict(instance_id: str, error: str) -> str:
    """Why the job fails when a rollout reports that it cannot do the job's work (a bad
    reward plug-in, a prompt too long): the error is the job's, and any rollout would meet
    it, so no replacement is tried."""
    return f"rollout {instance_id}: {error}"
