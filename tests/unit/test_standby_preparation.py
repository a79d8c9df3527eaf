"""Which free standbys (trainers and rollouts) the leader asks to PREPARE, and for which
running job; which bound members are missing from the registry, since when, and when the
leader records their loss itself."""

from __future__ import annotations

from robustrl.contracts.members import MemberRecord
from services.coordinator.jobs import JobRecord
from services.coordinator.policy import missing_members, standbys_to_prepare, unreported_losses


def trainer(name: str, *, job: str = "", **labels: str) -> MemberRecord:
    return MemberRecord(
        role="trainer", instance_id=name, address="h:1", pid=1, host="h", job_id=job, labels=labels
    )


def chosen(
    running: list[str], members: list[MemberRecord], preparing: dict[str, str]
) -> dict[str, str]:
    return {m.instance_id: job for m, job in standbys_to_prepare(running, members, preparing)}


def test_nothing_runs_nothing_is_prepared() -> None:
    assert chosen([], [trainer("s0", standby="true")], {}) == {}


def test_only_free_unprepared_standbys_are_asked() -> None:
    members = [
        trainer("t0", job="a"),  # the job's trainer
        trainer("t1"),  # free, but no standby: it may take a new job of its own
        trainer("s0", standby="true", prepared="a"),  # done already
        trainer("s1", standby="true"),  # a PREPARE is under way
        trainer("s2", standby="true", fenced="true"),
        trainer("s3", standby="true"),
        MemberRecord(role="rollout", instance_id="r0", address="h:2", pid=2, host="h"),
    ]
    assert chosen(["a"], members, {"s1": "a"}) == {"s3": "a"}


def test_standbys_spread_over_running_jobs_and_a_finished_jobs_standby_is_reused() -> None:
    members = [
        trainer("s0", standby="true", prepared="a"),
        trainer("s1", standby="true", prepared="gone"),  # its job ended
        trainer("s2", standby="true"),
        trainer("s3", standby="true"),
    ]
    # b has none and a has s0, so b first; then the fewest-served job each time (ties: the
    # first running job).
    assert chosen(["a", "b"], members, {}) == {"s1": "b", "s2": "a", "s3": "b"}


def test_standby_rollouts_are_prepared_and_counted_apart_from_standby_trainers() -> None:
    members = [
        trainer("s0", standby="true", prepared="a"),
        rollout("r0", job="a"),
        rollout("r1"),  # free, but no standby: it may start a job of its own
        rollout("sr0", standby="true"),
        rollout("sr1", standby="true"),
        rollout("sr2", standby="true"),
    ]
    # Neither a's standby trainer nor a trainer's PREPARE under way (s9) counts for a's
    # rollouts; sr2's PREPARE for b does: sr0 goes to a, then a tie goes to the first job.
    assert chosen(["a", "b"], members, {"sr2": "b", "s9": "a"}) == {"sr0": "a", "sr1": "a"}
    assert chosen(["a", "b"], members, {}) == {"sr0": "a", "sr1": "b", "sr2": "a"}


def test_a_bound_member_missing_from_the_registry_is_timed_from_when_it_went() -> None:
    record = job_a_with_t0_r0_r1()
    registered = [trainer("t0", job="a"), rollout("r0", job="a")]
    since: dict[tuple[str, str], float] = {}
    assert missing_members(record, registered, since, now=10.0) == [("r1", 10.0)]
    assert missing_members(record, registered, since, now=25.0) == [("r1", 10.0)]
    # Back in the registry (an etcd outage lapsed its lease): forgotten, timed afresh later.
    assert missing_members(record, [*registered, rollout("r1", job="a")], since, now=26.0) == []
    assert missing_members(record, registered, since, now=30.0) == [("r1", 30.0)]
    # No longer bound (recovery fenced it): forgotten too.
    record.member_roles.pop("r1")
    assert missing_members(record, registered, since, now=31.0) == [] and since == {}


def test_a_new_process_under_a_bound_members_name_is_not_that_member() -> None:
    """The whole stack stopped cleanly (no incident) and started again: new processes took the
    names of the job's members, free or in another job. The job's members count as missing,
    so the leader records their loss and the job is recovered instead of waiting for ever."""
    record = job_a_with_t0_r0_r1()
    again = [trainer("t0"), rollout("r0", job="b"), rollout("r1", job="a")]
    since: dict[tuple[str, str], float] = {}
    assert missing_members(record, again, since, now=5.0) == [("r0", 5.0), ("t0", 5.0)]


def test_a_member_missing_past_the_grace_is_reported_lost_with_where_it_went() -> None:
    record = job_a_with_t0_r0_r1()
    # r0's name was taken by a process of job b; r1 is gone.
    registered = [trainer("t0", job="a"), rollout("r0", job="b")]
    since: dict[tuple[str, str], float] = {}
    assert unreported_losses(record, registered, since, now=10.0, after=15.0) == []
    losses = unreported_losses(record, registered, since, now=25.0, after=15.0)
    assert [(loss.instance_id, loss.role) for loss in losses] == [
        ("r0", "rollout"),
        ("r1", "rollout"),
    ]
    assert losses[0].evidence == (
        "bound to job a but registered again as a member of b (a new process) for 15s, "
        "and no monitor reported it"
    )
    assert losses[1].evidence.startswith("bound to job a but missing from the registry for 15s")


def rollout(name: str, *, job: str = "", **labels: str) -> MemberRecord:
    return MemberRecord(
        role="rollout", instance_id=name, address="h:2", pid=2, host="h", job_id=job, labels=labels
    )


def job_a_with_t0_r0_r1() -> JobRecord:
    """Job a, running with trainer t0 and rollouts r0 and r1."""
    return JobRecord(
        job_id="a",
        spec={},
        created_at=0.0,
        updated_at=0.0,
        member_roles={"t0": "trainer", "r0": "rollout", "r1": "rollout"},
    )
