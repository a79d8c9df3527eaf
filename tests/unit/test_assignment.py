"""Which monitor watches which member: everyone computes the same answer, the load splits, and a
change of the monitors moves only the members it must."""

from __future__ import annotations

from robustrl.core.assignment import assignment_key, owner, ranked

MEMBERS = [f"rollout-{i:04d}" for i in range(2000)]


def owners(monitors: list[str]) -> dict[str, str | None]:
    return {m: owner(m, monitors) for m in MEMBERS}


def test_the_owner_is_the_first_ranked_whatever_the_order_the_monitors_are_listed_in() -> None:
    monitors = ["monitor-a", "monitor-b", "monitor-c"]
    for member in MEMBERS[:50]:
        first = ranked(member, monitors)[0]
        assert owner(member, monitors) == owner(member, list(reversed(monitors))) == first
    assert owner("rollout-0", []) is None


def test_the_members_split_about_evenly() -> None:
    monitors = ["monitor-a", "monitor-b"]
    counts = {m: 0 for m in monitors}
    for watched_by in owners(monitors).values():
        assert watched_by is not None
        counts[watched_by] += 1
    assert all(800 <= n <= 1200 for n in counts.values()), counts


def test_a_monitor_that_leaves_moves_only_its_members_and_one_that_joins_takes_a_share() -> None:
    before = owners(["monitor-a", "monitor-b", "monitor-c"])
    after = owners(["monitor-a", "monitor-b"])
    moved = [m for m in MEMBERS if before[m] != after[m]]
    assert moved and all(before[m] == "monitor-c" for m in moved)
    assert len(moved) == sum(1 for m in MEMBERS if before[m] == "monitor-c")
    joined = owners(["monitor-a", "monitor-b", "monitor-c", "monitor-d"])
    taken = [m for m in MEMBERS if joined[m] != before[m]]
    assert all(joined[m] == "monitor-d" for m in taken)
    assert 300 <= len(taken) <= 700  # about a quarter


def test_the_ranks_of_a_job_share_one_key_and_a_free_trainer_has_its_own() -> None:
    assert assignment_key("trainer", "trainer-0", "job-a") == "job:job-a"
    assert assignment_key("trainer", "trainer-0-rank1", "job-a") == "job:job-a"
    assert assignment_key("trainer", "standby-0", "") == "standby-0"
    assert assignment_key("rollout", "rollout-0", "job-a") == "rollout-0"
