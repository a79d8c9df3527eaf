"""The recovery policy recovers only the failed role, and nothing for stale incidents."""

from __future__ import annotations

from services.coordinator.recovery import (
    Do,
    IncidentFacts,
    JobFacts,
    decide,
    trainer_error_recovered,
)

MEMBERS = {
    "trainer-0": ("trainer", 1),
    "trainer-0-r1": ("trainer", 1),
    "rollout-0": ("rollout", 1),
    "rollout-1": ("rollout", 1),
}


def job(mode: str = "role_based", history: tuple[int, ...] = ()) -> JobFacts:
    return JobFacts("j", running=True, mode=mode, members=MEMBERS, nan_history=history)


def incident(
    kind: str, instance: str, role: str, *, epoch: int = 1, rank: int = 0
) -> IncidentFacts:
    return IncidentFacts("i1", "j", role, instance, epoch, kind, rank=rank, step=7)


def test_a_lost_or_hung_rollout_is_fenced_requeued_and_replaced_alone() -> None:
    for kind in ("MEMBER_LOST", "ROLLOUT_HANG"):
        actions = decide(incident(kind, "rollout-1", "rollout"), job())
        assert [(a.do, a.instance_id) for a in actions] == [
            (Do.FENCE, "rollout-1"),
            (Do.REQUEUE, "rollout-1"),
            (Do.REPLACE_ROLLOUT, "rollout-1"),
        ]


def test_a_trainer_failure_fences_every_rank_and_restores_without_touching_rollouts() -> None:
    for kind in ("MEMBER_LOST", "TRAINER_HANG", "COLLECTIVE_HANG", "TRAINER_ERROR"):
        actions = decide(incident(kind, "trainer-0-r1", "trainer", rank=1), job())
        assert {a.instance_id for a in actions if a.do is Do.FENCE} == {"trainer-0", "trainer-0-r1"}
        assert actions[-1].do is Do.RESTORE_TRAINER
        assert not any("rollout" in a.instance_id for a in actions)


def test_nan_rolls_back_and_a_rank_that_repeats_it_alone_is_replaced() -> None:
    [rollback] = decide(incident("NON_FINITE", "trainer-0", "trainer"), job())
    assert rollback.do is Do.ROLLBACK and "step 7" in rollback.reason
    # Rank 1 again, rank 0 clean: the machine, not the data.
    actions = decide(incident("NON_FINITE", "trainer-0-r1", "trainer", rank=1), job(history=(1,)))
    assert actions[-1].do is Do.RESTORE_TRAINER and "rank 1" in actions[-1].reason
    # NaN on different ranks points at the data: roll back only.
    mixed = decide(incident("NON_FINITE", "trainer-0-r1", "trainer", rank=1), job(history=(0, 1)))
    assert [a.do for a in mixed] == [Do.ROLLBACK]


def test_a_trainer_error_is_recovered_until_a_replacement_stops_no_further() -> None:
    assert trainer_error_recovered(5, [])  # the first error: the machine is suspect
    assert trainer_error_recovered(9, [5])  # the replacement got past step 5: again a machine
    assert trainer_error_recovered(12, [5, 9])
    # Stopped at or before a step where an earlier trainer stopped: the job's own error.
    assert not trainer_error_recovered(5, [5])
    assert not trainer_error_recovered(4, [5])
    assert not trainer_error_recovered(9, [5, 9])


def test_stale_unrelated_and_warning_incidents_change_nothing() -> None:
    assert decide(incident("MEMBER_LOST", "rollout-1", "rollout", epoch=0), job()) == []
    assert decide(incident("MEMBER_LOST", "rollout-9", "rollout"), job()) == []
    assert decide(incident("DEGRADED", "rollout-1", "rollout"), job()) == []
    stopped = JobFacts("j", running=False, mode="role_based", members=MEMBERS)
    assert decide(incident("MEMBER_LOST", "rollout-1", "rollout"), stopped) == []


def test_full_restart_mode_restarts_everything_for_any_failure() -> None:
    for kind, who, role in (
        ("ROLLOUT_HANG", "rollout-0", "rollout"),
        ("NON_FINITE", "trainer-0", "trainer"),
    ):
        [action] = decide(incident(kind, who, role), job(mode="full_restart"))
        assert action.do is Do.FULL_RESTART


def test_an_incident_about_a_trainer_rank_is_about_the_trainer_that_runs_it() -> None:
    from robustrl.contracts.incidents import IncidentRecord
    from services.coordinator.executor import serving_instance
    from services.coordinator.jobs import JobRecord

    record = JobRecord(
        job_id="j",
        spec={},
        created_at=0.0,
        updated_at=0.0,
        member_roles={"trainer-0": "trainer", "rollout-0": "rollout"},
    )

    def about(instance: str, role: str) -> str:
        incident = IncidentRecord(
            incident_id="i",
            job_id="j",
            role=role,
            instance_id=instance,
            rank=1,
            kind="COLLECTIVE_HANG",
            evidence="",
            confidence=0.9,
            detected_at=0.0,
            epoch=0,
        )
        return serving_instance(record, incident)

    assert about("trainer-0-rank1", "trainer") == "trainer-0"
    assert about("rollout-0", "rollout") == "rollout-0"
    assert about("trainer-9-rank1", "trainer") == "trainer-9-rank1"  # not this job's: no action
