"""When a failure is the job's own and the job fails instead of being recovered: poison
groups, a trainer's error that comes back on its replacement, a rollout's error."""

from __future__ import annotations

from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.jobspec import RecoverySpec
from services.coordinator.policy import (
    leased_alone,
    poison_group,
    poison_verdict,
    rollout_error_verdict,
    trainer_error_recovered,
    trainer_error_verdict,
)


def test_a_trainer_error_is_recovered_until_a_replacement_stops_no_further() -> None:
    assert trainer_error_recovered(5, [])  # the first error: the machine is suspect
    assert trainer_error_recovered(9, [5])  # the replacement got past step 5: again a machine
    assert trainer_error_recovered(12, [5, 9])
    # Stopped at or before a step where an earlier trainer stopped: the job's own error.
    assert not trainer_error_recovered(5, [5])
    assert not trainer_error_recovered(4, [5])
    assert not trainer_error_recovered(9, [5, 9])


def test_a_group_is_poison_once_it_lost_the_limit_of_holders_and_never_without_a_limit() -> None:
    assert not poison_group(2, 3)
    assert poison_group(3, 3) and poison_group(4, 3)
    assert not poison_group(100, 0)
    assert leased_alone("g1", {"g1": 1}) and not leased_alone("g2", {"g1": 1})


def test_the_job_fails_once_the_poison_groups_reach_the_limit() -> None:
    recovery = RecoverySpec(group_losses=1, poison_groups=2)
    assert poison_verdict("j", recovery, 1) == ""
    why = poison_verdict("j", recovery, 2)
    assert "2 prompt groups were dropped as poison groups" in why
    assert "recovery.poison_groups is 2" in why and "`robustrl dropped j`" in why
    assert poison_verdict("j", RecoverySpec(group_losses=1, poison_groups=0), 100) == ""


def trainer_error(instance: str, epoch: int, step: int) -> IncidentRecord:
    return IncidentRecord(
        incident_id=f"i-{instance}",
        job_id="j",
        role="trainer",
        instance_id=instance,
        rank=0,
        kind="TRAINER_ERROR",
        evidence="",
        confidence=1.0,
        detected_at=0.0,
        epoch=epoch,
        step=step,
    )


def test_a_trainers_error_is_recovered_once_per_trainer_and_fails_the_job_when_it_comes_back() -> (
    None
):
    first = trainer_error_verdict("t0", "ECC", in_job=False, step=5, epoch=1, earlier=[])
    assert first.recover and not first.fail
    earlier = [trainer_error("t0", 1, 5)]
    # The same report again (its answer was lost): recorded already, nothing more.
    again = trainer_error_verdict("t0", "ECC", in_job=False, step=5, epoch=1, earlier=earlier)
    assert not again.recover and not again.fail
    # The replacement got further: a machine again.
    further = trainer_error_verdict("t1", "ECC", in_job=False, step=8, epoch=2, earlier=earlier)
    assert further.recover
    # The replacement stopped at the same step: the job's own error.
    same = trainer_error_verdict("t1", "boom", in_job=False, step=5, epoch=2, earlier=earlier)
    assert not same.recover
    assert same.fail == (
        "trainer t1: boom (at step 5, after a trainer that stopped at step 5 was replaced: "
        "the error is the job's, not a machine's)"
    )


def test_an_error_the_trainer_finds_in_the_job_fails_it_at_once() -> None:
    verdict = trainer_error_verdict("t0", "bad reward", in_job=True, step=1, epoch=1, earlier=[])
    assert verdict.fail == "trainer t0: bad reward" and not verdict.recover


def test_a_rollouts_reported_error_fails_the_job_naming_the_rollout() -> None:
    assert rollout_error_verdict("r0", "prompt too long") == "rollout r0: prompt too long"
