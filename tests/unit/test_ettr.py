from __future__ import annotations

import random

import pytest

from robustrl.contracts.ettr import (
    FOLD_AFTER_S,
    MAX_INCIDENTS,
    STALL_FACTOR,
    EttrAccount,
    IncidentTiming,
    Span,
    fold_horizon,
    union_length,
)


def test_union_of_overlapping_unordered_intervals_counts_each_second_once() -> None:
    spans = [Span(start=5, end=8), Span(start=0, end=2), Span(start=1, end=3), Span(start=7, end=9)]
    assert union_length(spans, 0, 100) == pytest.approx(3 + 4)
    assert union_length(spans, 1.5, 7.5) == pytest.approx(1.5 + 2.5)
    assert union_length([], 0, 10) == 0.0


def test_steps_and_generations_overlapping_in_any_order_are_a_union() -> None:
    account = EttrAccount(started_at=0.0)
    account.add_step(2, 4.0, 6.0)
    account.add_generation(0.0, 3.0)
    account.add_step(1, 2.0, 4.0)  # reported late, overlaps a generation
    account.add_generation(5.0, 7.0)
    account.add_generation(1.0, 2.0)  # inside another
    # Union: [0, 7]; the job ran for 10 s.
    assert account.effective(10.0) == pytest.approx(7.0)
    assert account.ettr(10.0) == pytest.approx(0.7)
    assert [(g.start, g.end) for g in account.generations] == [(0.0, 3.0), (5.0, 7.0)]


def test_generation_intervals_merge_as_they_arrive() -> None:
    account = EttrAccount(started_at=0.0)
    for start in random.Random(1).sample(range(100), 100):
        account.add_generation(float(start), start + 1.5)
    assert [(g.start, g.end) for g in account.generations] == [(0.0, 100.5)]


def test_a_roll_back_removes_exactly_the_lost_steps() -> None:
    account = EttrAccount(started_at=0.0)
    for step in range(1, 7):
        account.add_step(step, step - 1.0, float(step))
    account.roll_back(4)  # restored from step 4's checkpoint: steps 5 and 6 are gone
    assert sorted(s.step for s in account.steps) == [1, 2, 3, 4]
    assert account.effective(6.0) == pytest.approx(4.0)
    assert (account.rolled_back_steps, account.rolled_back_s) == (2, pytest.approx(2.0))
    # Recomputed steps count again.
    account.add_step(5, 8.0, 9.0)
    assert account.effective(10.0) == pytest.approx(5.0)


def test_generation_that_is_used_keeps_ettr_up_while_the_trainer_restarts() -> None:
    """Steps every second; the trainer dies at 10 s and is back at 20 s, restored from step 10.
    Rollouts generated through the restart and those groups trained afterwards."""
    trainer_only = EttrAccount(started_at=0.0)
    with_rollouts = EttrAccount(started_at=0.0)
    for account in (trainer_only, with_rollouts):
        for step in range(1, 11):
            account.add_step(step, step - 1.0, float(step))
        for step in range(11, 21):
            account.add_step(step, step + 9.0, step + 10.0)
        account.end(30.0)
    for t in range(10, 20):
        with_rollouts.add_generation(float(t), t + 1.0)
    assert trainer_only.ettr(99.0) == pytest.approx(20 / 30)
    assert with_rollouts.ettr(99.0) == pytest.approx(1.0)


def test_generation_that_was_not_used_counts_for_nothing() -> None:
    account = EttrAccount(started_at=0.0)
    account.add_step(1, 0.0, 1.0)
    # A rollout generated during [1, 5] but the groups went stale: add_generation never called.
    assert account.ettr(5.0) == pytest.approx(0.2)


def test_a_fault_free_timeline_is_about_one() -> None:
    account = EttrAccount(started_at=100.0)
    # 2 s start-up generating the first groups, then steps of 1 s with rollouts generating
    # the next groups alongside; a 10 ms gap between steps.
    account.add_generation(100.0, 102.0)
    t = 102.0
    for step in range(1, 101):
        account.add_step(step, t, t + 1.0)
        account.add_generation(t, t + 0.9)
        t += 1.01
    account.end(t)
    assert account.ettr(t) == pytest.approx(1.0, abs=0.02)
    assert account.ettr(t + 1000) == account.ettr(t)  # the job ended: the clock stopped


def test_a_wait_longer_than_usual_counts_only_up_to_the_bound() -> None:
    """Steps every second (0.2 s waiting for data, 0.8 s of work); then the trainer waits 20 s
    for rollouts that a full restart brought down: only STALL_FACTOR typical intervals of that
    step count, and the first step of the job, with no typical interval yet, counts its work."""
    account = EttrAccount(started_at=0.0)
    for step in range(1, 11):
        account.add_step(step, step - 1.0, float(step), work_start=step - 0.8)
    assert account.effective(10.0) == pytest.approx(0.8 + 9.0)
    account.add_step(11, 10.0, 31.0, work_start=30.2)
    assert account.effective(31.0) == pytest.approx(0.8 + 9.0 + STALL_FACTOR * 1.0)
    assert account.stalled_s == pytest.approx(0.2 + 21.0 - STALL_FACTOR * 1.0)
    # A slow step that was all work counts whole, however long.
    account.add_step(12, 31.0, 41.0, work_start=31.0)
    assert account.effective(41.0) == pytest.approx(0.8 + 9.0 + STALL_FACTOR + 10.0)


def test_steps_that_alternate_short_and_long_waits_count_whole() -> None:
    """A pipelined job: every other batch is ready at once (0.05 s intervals), the others are
    waited for (0.2 s), as on the local stack. All of it is the usual wait and counts; a 20 s
    wait after that still counts only STALL_FACTOR typical (long) intervals."""
    account = EttrAccount(started_at=0.0)
    t = 0.0

    def alternate(steps: range) -> None:
        nonlocal t
        for step in steps:
            interval = 0.05 if step % 2 else 0.2
            account.add_step(step, t, t + interval, work_start=t + interval - 0.04)
            t += interval

    alternate(range(1, 11))  # a few intervals in: the typical one is known
    warm_t, warm_effective, warm_stalled = t, account.effective(t), account.stalled_s
    alternate(range(11, 61))
    assert account.effective(t) - warm_effective == pytest.approx(t - warm_t)
    assert account.stalled_s == pytest.approx(warm_stalled)

    account.add_step(61, t, t + 20.0, work_start=t + 19.96)
    assert account.stalled_s == pytest.approx(warm_stalled + 20.0 - STALL_FACTOR * 0.2)


def test_a_stall_is_covered_only_by_generation_that_was_used() -> None:
    """The same 20 s trainer wait: role-based recovery kept rollouts generating used groups
    through it, a full restart had no rollouts for 15 s of it."""
    role_based, full_restart = EttrAccount(started_at=0.0), EttrAccount(started_at=0.0)
    for account in (role_based, full_restart):
        for step in range(1, 11):
            account.add_step(step, step - 1.0, float(step), work_start=step - 0.8)
            account.add_generation(step - 1.0, float(step))
        account.add_step(11, 10.0, 31.0, work_start=30.2)
        account.end(31.0)
    role_based.add_generation(10.0, 30.2)
    full_restart.add_generation(25.0, 30.2)
    assert role_based.ettr(31.0) == pytest.approx(1.0)
    # [0, 10] of steps and their generation, then [25, 31]: generation up to the step's end.
    assert full_restart.ettr(31.0) == pytest.approx((10.0 + 6.0) / 31.0)


def test_compaction_keeps_the_numbers_identical() -> None:
    rng = random.Random(7)
    plain = EttrAccount(started_at=0.0)
    compacted = EttrAccount(started_at=0.0)
    step, checkpoint, t = 0, 0, 0.0
    for _ in range(400):
        t += rng.uniform(0.1, 1.0)
        if rng.random() < 0.05 and step > checkpoint:
            for a in (plain, compacted):
                a.roll_back(checkpoint)
            step = checkpoint
            continue
        step += 1
        duration = rng.uniform(0.2, 1.5)
        gen_start = t - rng.uniform(0.0, 3.0)  # used groups arrive within the staleness window
        gen_end = gen_start + rng.uniform(0.1, 2.0)
        for a in (plain, compacted):
            a.add_step(step, t, t + duration)
            a.add_generation(gen_start, gen_end)
        if step % 5 == 0:
            checkpoint = step
        compacted.compact(t - 5.0, checkpoint_step=checkpoint)
        for now in (t, t + 2.0):
            assert compacted.effective(now) == pytest.approx(plain.effective(now), abs=1e-9)
    assert compacted.rolled_back_s == pytest.approx(plain.rolled_back_s)
    assert len(compacted.steps) + len(compacted.generations) < 40
    assert len(plain.steps) > 300


def test_the_fold_horizon_is_the_earliest_generation_still_out() -> None:
    assert fold_horizon(1000.0, [], [], 60.0) == 1000.0  # nothing out: everything may fold
    assert fold_horizon(1000.0, [990.0, 995.0], [], 60.0) == 990.0  # delivered, not trained
    assert fold_horizon(1000.0, [995.0], [1030.0], 60.0) == 970.0  # leased at 970
    # However long something stays out, history older than FOLD_AFTER_S folds.
    assert fold_horizon(1000.0, [10.0], [], 60.0) == 1000.0 - FOLD_AFTER_S


def test_a_fast_job_keeps_a_small_account_with_the_same_numbers() -> None:
    """At the local stack's pace (5 steps a second, each trained group generated in the step
    before), folding only after FOLD_AFTER_S kept every step of the last ten minutes: the
    account, written to etcd on every step, grew to hundreds of KB and a long job filled
    etcd's quota. Folding up to the earliest generation still out keeps it small, and its
    numbers stay those of an account that never folds."""
    plain = EttrAccount(started_at=0.0)
    by_time = EttrAccount(started_at=0.0)
    by_work = EttrAccount(started_at=0.0)
    pending: dict[str, tuple[float, float]] = {}  # delivered, not trained: group -> span
    leases: dict[str, float] = {}  # out on a lease: group -> deadline
    for step in range(1, 3001):
        t = step * 0.2
        for group in list(pending):  # the step trains what was delivered before it
            start, end = pending.pop(group)
            for a in (plain, by_time, by_work):
                a.add_generation(start, end)
        for group in list(leases):  # generated during the step, delivered at its end
            del leases[group]
            pending[group] = (t - 0.15, t - 0.02)
        for k in range(4):
            leases[f"{step}-{k}"] = t + 60.0
        for a in (plain, by_time, by_work):
            a.add_step(step, t - 0.2, t)
        by_time.compact(t - FOLD_AFTER_S, checkpoint_step=step - 1)
        horizon = fold_horizon(t, (s for s, _ in pending.values()), leases.values(), 60.0)
        by_work.compact(horizon, checkpoint_step=step - 1)
        if step % 500 == 0:
            for a in (by_time, by_work):
                assert a.effective(t) == pytest.approx(plain.effective(t), abs=1e-6)
    assert len(by_time.model_dump_json()) > 100_000  # the old rule, for scale
    assert len(by_work.model_dump_json()) < 5_000


def test_compaction_stops_at_steps_that_may_still_be_rolled_back() -> None:
    account = EttrAccount(started_at=0.0)
    for step in range(1, 11):
        account.add_step(step, step - 1.0, float(step))
    account.compact(9.5, checkpoint_step=6)  # steps 7.. may be rolled back: stop at 6.0
    assert account.horizon == pytest.approx(6.0)
    assert sorted(s.step for s in account.steps) == [7, 8, 9, 10]
    account.roll_back(6)
    assert account.effective(10.0) == pytest.approx(6.0)


def test_a_roll_back_below_what_was_compacted_is_refused() -> None:
    account = EttrAccount(started_at=0.0)
    for step in range(1, 5):
        account.add_step(step, step - 1.0, float(step))
    account.compact(3.5)  # no checkpoint named: the caller promised step 4 is safe
    with pytest.raises(ValueError, match="compacted"):
        account.roll_back(2)
    account.roll_back(4)  # a no-op, allowed


def test_an_interval_reaching_behind_the_horizon_counts_from_the_horizon() -> None:
    account = EttrAccount(started_at=0.0)
    account.add_generation(0.0, 4.0)
    account.compact(5.0)
    account.add_generation(3.0, 6.0)  # [3, 4] was counted already
    assert account.effective(10.0) == pytest.approx(5.0)


def test_bad_intervals_are_refused() -> None:
    account = EttrAccount(started_at=0.0)
    with pytest.raises(ValueError):
        account.add_step(1, 2.0, 1.0)
    with pytest.raises(ValueError):
        account.add_generation(float("nan"), 1.0)


def test_the_account_survives_a_round_trip_through_json() -> None:
    account = EttrAccount(started_at=0.0)
    account.add_step(1, 0.0, 1.0)
    account.add_generation(0.5, 2.0)
    account.compact(1.5, checkpoint_step=1)
    account.add_incident(
        IncidentTiming(
            incident_id="i1",
            kind="MEMBER_LOST",
            role="rollout",
            instance_id="rollout-1",
            failed_at=1.0,
            detected_at=2.0,
        )
    )
    again = EttrAccount.model_validate_json(account.model_dump_json())
    assert again == account
    assert again.effective(3.0) == pytest.approx(2.0)


def test_incident_timings_detection_and_recovery_and_a_bounded_list() -> None:
    account = EttrAccount(started_at=0.0)
    timing = IncidentTiming(
        incident_id="i0",
        kind="ROLLOUT_HANG",
        role="rollout",
        instance_id="rollout-0",
        failed_at=10.0,
        detected_at=14.5,
    )
    account.add_incident(timing)
    assert (timing.detection_s, timing.recovery_s) == (pytest.approx(4.5), None)
    account.recovered("i0", 20.0)
    assert account.incidents[0].recovery_s == pytest.approx(5.5)
    unknown_failure = timing.model_copy(update={"incident_id": "i1", "failed_at": None})
    assert unknown_failure.detection_s is None

    for i in range(1, MAX_INCIDENTS + 10):
        account.add_incident(timing.model_copy(update={"incident_id": f"i{i}"}))
    assert len(account.incidents) == MAX_INCIDENTS
    assert account.incidents_total == MAX_INCIDENTS + 10
    assert account.incidents[-1].incident_id == f"i{MAX_INCIDENTS + 9}"
    summary = account.summary(30.0)
    incidents = summary["incidents"]
    assert isinstance(incidents, list) and incidents[-1]["detection_s"] == pytest.approx(4.5)
