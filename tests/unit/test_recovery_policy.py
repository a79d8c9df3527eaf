"""The recovery policy recovers only the failed role, and nothing for stale incidents: an
incident about a member no longer serving the job, or about an earlier binding of a member
that serves it again at a higher epoch."""

from __future__ import annotations

from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.members import MemberRecord
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.policy import (
    Do,
    IncidentFacts,
    JobFacts,
    decide,
    facts,
    incident_facts,
    leader_subject,
    serving_epochs,
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


def running_job(epoch: int, member_roles: dict[str, str]) -> JobRecord:
    return JobRecord(
        job_id="j",
        phase=Phase.RUNNING,
        spec={},
        created_at=0.0,
        updated_at=0.0,
        epoch=epoch,
        member_roles=member_roles,
    )


def registered(name: str, role: str, *, job: str = "j", epoch: int) -> MemberRecord:
    return MemberRecord(
        role=role, instance_id=name, address="h:1", pid=1, host="h", job_id=job, epoch=epoch
    )


def reported(name: str, role: str, kind: str, *, epoch: int) -> IncidentRecord:
    """An incident as the monitor records it: the epoch is the one the member beat with."""
    return IncidentRecord(
        incident_id="i",
        job_id="j",
        role=role,
        instance_id=name,
        rank=0,
        kind=kind,
        evidence="",
        confidence=0.9,
        detected_at=0.0,
        epoch=epoch,
    )


def decided(
    record: JobRecord,
    incident: IncidentRecord,
    members: list[MemberRecord],
    mode: str = "role_based",
) -> list[Do]:
    actions = decide(incident_facts(record, incident), facts(record, mode, [], members))
    return [a.do for a in actions]


def test_an_incident_about_an_earlier_binding_of_a_member_bound_again_changes_nothing() -> None:
    """A full restart lets every member but the failed one go without a fence; a process that
    took rollout-1's name was bound again at epoch 3. An incident about the rollout-1 that
    served at epoch 2 (handled late: by a leader elected after the rebind, say) is not about
    the one serving now, which must not be fenced for it."""
    record = running_job(3, {"trainer-0": "trainer", "rollout-1": "rollout"})
    members = [
        registered("trainer-0", "trainer", epoch=3),
        registered("rollout-1", "rollout", epoch=3),
    ]
    for mode in ("role_based", "full_restart"):
        earlier = reported("rollout-1", "rollout", "MEMBER_LOST", epoch=2)
        assert decided(record, earlier, members, mode) == []
        now = reported("rollout-1", "rollout", "MEMBER_LOST", epoch=3)
        assert decided(record, now, members, mode) != []


def test_a_rollout_bound_before_the_trainer_was_replaced_is_judged_at_its_own_epoch() -> None:
    """The job is at epoch 2 since its trainer was replaced; rollout-1 still serves at the
    epoch 1 it was bound at, and its loss is recovered."""
    record = running_job(2, {"trainer-1": "trainer", "rollout-1": "rollout"})
    members = [
        registered("trainer-1", "trainer", epoch=2),
        registered("rollout-1", "rollout", epoch=1),
    ]
    assert serving_epochs(record, members) == {"trainer-1": 2, "rollout-1": 1}
    lost = reported("rollout-1", "rollout", "ROLLOUT_HANG", epoch=1)
    assert decided(record, lost, members) == [Do.FENCE, Do.REQUEUE, Do.REPLACE_ROLLOUT]


def test_a_member_gone_from_the_registry_or_its_name_in_another_job_is_judged_by_membership() -> (
    None
):
    record = running_job(2, {"trainer-1": "trainer", "rollout-1": "rollout"})
    lost = reported("rollout-1", "rollout", "MEMBER_LOST", epoch=1)
    assert decided(record, lost, []) == [Do.FENCE, Do.REQUEUE, Do.REPLACE_ROLLOUT]
    # Epochs count per job: a higher one in another job says nothing of this one.
    elsewhere = [registered("rollout-1", "rollout", job="other", epoch=7)]
    assert serving_epochs(record, elsewhere) == {}
    assert decided(record, lost, elsewhere) == [Do.FENCE, Do.REQUEUE, Do.REPLACE_ROLLOUT]


def test_an_incident_about_any_rank_of_a_trainer_group_replaces_the_whole_group() -> None:
    """Every rank is a member of the job at the group's epoch: the rank named is fenced with
    its group. A rank of an earlier group (fenced already) changes nothing."""
    record = running_job(
        2, {"trainer-0": "trainer", "trainer-1": "trainer", "rollout-0": "rollout"}
    )
    members = [
        registered("trainer-0", "trainer", epoch=2),
        registered("trainer-1", "trainer", epoch=2),
    ]
    hang = reported("trainer-1", "trainer", "COLLECTIVE_HANG", epoch=2)
    assert incident_facts(record, hang).epoch == 2
    assert decided(record, hang, members) == [Do.FENCE, Do.FENCE, Do.RESTORE_TRAINER]
    earlier = reported("trainer-7", "trainer", "MEMBER_LOST", epoch=1)
    assert decided(record, earlier, members) == []


def test_an_incident_the_leader_records_is_never_taken_for_an_earlier_bindings() -> None:
    """The leader records a loss no monitor reported, or a trainer's reported error, at the
    job's epoch: no member serves at a higher one."""
    record = running_job(2, {"trainer-1": "trainer", "rollout-1": "rollout"})
    subject = leader_subject(record, "rollout-1")
    assert (subject.role, subject.epoch, subject.job_id) == ("rollout", 2, "j")
    members = [
        registered("trainer-1", "trainer", epoch=2),
        registered("rollout-1", "rollout", epoch=1),
    ]
    found = reported("rollout-1", "rollout", "MEMBER_LOST", epoch=subject.epoch)
    assert decided(record, found, members) == [Do.FENCE, Do.REQUEUE, Do.REPLACE_ROLLOUT]


def test_the_facts_of_a_job_that_is_not_running_lead_to_nothing() -> None:
    record = running_job(1, {"rollout-1": "rollout"}).model_copy(update={"phase": Phase.PENDING})
    assert not facts(record, "role_based", []).running
    assert decided(record, reported("rollout-1", "rollout", "MEMBER_LOST", epoch=1), []) == []
