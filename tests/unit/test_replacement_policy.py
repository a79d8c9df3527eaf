"""Who is bound to a job: the members it starts on, which free member replaces a lost one and
what the leader does with it, and how many replacements it asks the provisioner for."""

from __future__ import annotations

from robustrl.contracts.members import MemberRecord
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.policy import (
    ASKED_FOR_S,
    Step,
    asks_due,
    bindable,
    filled,
    free_members,
    replacement_epoch,
    replacement_order,
    replacement_step,
    roles_missing,
    start_members,
)


def member(role: str, name: str, *, job: str = "", **labels: str) -> MemberRecord:
    return MemberRecord(
        role=role, instance_id=name, address="h:1", pid=1, host="h", job_id=job, labels=labels
    )


def record(phase: Phase = Phase.RUNNING, **fields: object) -> JobRecord:
    return JobRecord.model_validate(
        {"job_id": "j", "phase": phase, "spec": {}, "created_at": 0.0, "updated_at": 0.0, **fields}
    )


def names(members: list[MemberRecord]) -> list[str]:
    return [m.instance_id for m in members]


def test_only_free_members_that_stay_are_bindable_and_fenced_ids_are_passed_over() -> None:
    members = [
        member("rollout", "r0"),
        member("rollout", "r1", job="other"),
        member("rollout", "r2", fenced="true"),
        member("rollout", "r3", leaving="true"),
        member("trainer", "t1", job="j", rank="1", follower="true"),
        member("trainer", "t0"),
        member("rollout", "r4"),
    ]
    assert names(free_members(members, "rollout")) == ["r0", "r4"]
    assert names(free_members(members, "trainer")) == ["t0"]
    free, barred = bindable(members, lambda instance: instance == "r4")
    assert (names(free["trainer"]), names(free["rollout"]), barred) == (["t0"], ["r0"], {"r4"})


def test_a_job_starts_on_a_free_trainer_that_is_no_standby_and_enough_rollouts() -> None:
    free = {
        "trainer": [member("trainer", "s0", standby="true"), member("trainer", "t0")],
        "rollout": [
            member("rollout", "sr0", standby="true"),  # waits for a rollout to fail
            member("rollout", "r0"),
            member("rollout", "r1"),
            member("rollout", "r2"),
        ],
    }
    assert names(start_members(free, 2).members) == ["t0", "r0", "r1"]
    short = start_members(free, 4)
    assert short.members == []
    assert short.waiting == (
        "waiting for 1 free trainer and 4 free rollouts (free now: 1 trainers, 3 rollouts)"
    )
    standbys_only = start_members({**free, "trainer": free["trainer"][:1]}, 1)
    assert standbys_only.members == [] and "free now: 0 trainers" in standbys_only.waiting


def test_a_job_of_two_ranks_starts_on_two_free_trainers_each_with_its_rank() -> None:
    free = {
        "trainer": [member("trainer", "t0"), member("trainer", "s0", standby="true")],
        "rollout": [member("rollout", "r0")],
    }
    waiting = start_members(free, 1, trainers=2)
    assert waiting.members == [] and waiting.waiting.startswith("waiting for 2 free trainers")
    free["trainer"].append(member("trainer", "t1"))
    start = start_members(free, 1, trainers=2)
    assert names(start.members) == ["t0", "t1", "r0"]
    assert start.ranks == {"t0": 0, "t1": 1}


def test_the_roles_a_job_lost_are_bound_again_a_new_trainer_at_a_new_epoch() -> None:
    lost_trainer = record(members=["r0"], member_roles={"r0": "rollout"}, epoch=3)
    assert roles_missing(lost_trainer, 2) == ["trainer", "rollout"]
    assert replacement_epoch(3, ["trainer", "rollout"]) == 4
    full = record(members=["t", "r0"], member_roles={"t": "trainer", "r0": "rollout"})
    assert roles_missing(full, 1) == []
    assert roles_missing(full, 3) == ["rollout", "rollout"]
    assert replacement_epoch(3, ["rollout"]) == 3
    # A trainer group is fenced whole, and bound again whole.
    assert roles_missing(lost_trainer, 1, trainers=2) == ["trainer", "trainer"]
    # A record from before roles were kept: nothing to compare with.
    assert roles_missing(record(members=["t", "r0"]), 2) == []


def test_replacements_are_taken_prepared_first_and_standbys_before_the_others() -> None:
    found = [
        member("trainer", "cold"),
        member("trainer", "s-other", standby="true", prepared="other"),
        member("trainer", "prepared", prepared="j"),
        member("trainer", "s-prepared", standby="true", prepared="j"),
        member("trainer", "s-new", standby="true"),
    ]
    assert names(replacement_order(found, "j")) == [
        "s-prepared",
        "prepared",
        "s-other",
        "s-new",
        "cold",
    ]


def test_only_a_member_prepared_for_the_job_is_bound_the_others_are_prepared_first() -> None:
    prepared = member("rollout", "r0", prepared="j")
    unprepared = member("rollout", "r1")
    assert replacement_step(prepared, "j", None) is Step.BIND
    assert replacement_step(unprepared, "j", None) is Step.PREPARE
    assert replacement_step(unprepared, "j", "j") is Step.AWAIT
    assert replacement_step(unprepared, "j", "other") is Step.SKIP
    assert replacement_step(member("rollout", "r2", prepared="other"), "j", None) is Step.PREPARE


def test_a_recovering_job_runs_again_once_a_trainer_is_bound_at_the_new_epoch() -> None:
    recovering = record(
        Phase.RECOVERING,
        members=["r0"],
        member_roles={"r0": "rollout"},
        epoch=1,
        weight_version=7,
        message="recovering from MEMBER_LOST of t0",
    )
    group = [member("trainer", "t1"), member("trainer", "t2")]
    done = filled(recovering, group, 2, {"t1": 0, "t2": 1})
    assert (done.phase, done.message) == (Phase.RUNNING, "running (recovered)")
    assert done.change == {
        "members": ["r0", "t1", "t2"],
        "member_roles": {"r0": "rollout", "t1": "trainer", "t2": "trainer"},
        "member_ranks": {"t1": 0, "t2": 1},
        "epoch": 2,
        "weight_version": 0,
    }
    running = record(members=["t1"], member_roles={"t1": "trainer"}, epoch=2, message="running")
    rollout = filled(running, [member("rollout", "r2")], 2)
    assert (rollout.phase, rollout.message) == (None, "running")
    assert "weight_version" not in rollout.change


def test_replacements_asked_for_recently_are_not_asked_for_again() -> None:
    now = 1000.0
    coming, due = asks_due([now - ASKED_FOR_S - 1, now - 5.0], 3, now)
    assert (coming, due) == ([now - 5.0], 2)
    assert asks_due([now - 1.0, now - 2.0], 1, now) == ([now - 1.0, now - 2.0], 0)
