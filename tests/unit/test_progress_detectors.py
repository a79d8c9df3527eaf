"""Role-aware detectors: they fire on real failures and never on normal RL behaviour."""

from __future__ import annotations

from services.monitor import detectors as d
from services.monitor import progress_detectors as pd

CFG = pd.ProgressConfig(rollout_hang_window=10.0, collective_budget=30.0)


def rollout(name: str = "r0", job: str = "j") -> pd.Signals:
    return pd.Signals(role="rollout", instance_id=name, job_id=job)


def beat(
    s: pd.Signals, now: float, *, tokens: float, in_flight: float, rate: float = 100.0
) -> None:
    pd.observe(
        s,
        phase="generating",
        phase_started_at=0.0,
        now=now,
        counters={
            "tokens_generated": tokens,
            "requests_in_flight": in_flight,
            "tokens_per_s": rate,
        },
    )


def test_a_rollout_with_requests_and_no_tokens_is_a_hang_suspect() -> None:
    r = rollout()
    beat(r, 0.0, tokens=100, in_flight=4)
    beat(r, 5.0, tokens=100, in_flight=4)
    assert pd.rollout_hang_suspects([r], 9.0, CFG) == []
    [finding] = pd.rollout_hang_suspects([r], 10.5, CFG)
    assert finding.kind == "ROLLOUT_HANG_SUSPECT" and "4 requests in flight" in finding.evidence


def test_a_weight_update_that_never_ends_is_a_hang_suspect_and_one_that_ends_is_not() -> None:
    stuck, done = rollout("stuck"), rollout("done")
    for r in (stuck, done):
        beat(r, 0.0, tokens=100, in_flight=0)  # between generations
    for t in (1.0, 6.0):
        pd.observe(
            stuck,
            phase="pulling_weights",
            phase_started_at=1.0,
            now=t,
            counters={"tokens_generated": 100, "weight_updates_in_flight": 1},
        )
    beat(done, 6.0, tokens=100, in_flight=0)  # its update ended: nothing asked of it
    [finding] = pd.rollout_hang_suspects([stuck, done], 11.5, CFG)
    assert finding.instance_id == "stuck" and "a weight update in flight" in finding.evidence


def test_long_tail_generation_and_idleness_are_never_hangs() -> None:
    long_tail, idle = rollout("tail"), rollout("idle")
    for t in range(0, 200, 5):
        beat(long_tail, float(t), tokens=float(t), in_flight=1)  # one slow request, tokens flowing
        beat(idle, float(t), tokens=50, in_flight=0)  # waiting for weights or work
    assert pd.rollout_hang_suspects([long_tail, idle], 200.0, CFG) == []


def test_a_trainer_phase_over_its_budget_is_a_hang_but_waiting_for_data_never_is() -> None:
    busy = pd.Signals(
        role="trainer", instance_id="t0", phase="forward_backward", phase_started_at=1000.0
    )
    waiting = pd.Signals(
        role="trainer", instance_id="t1", phase="waiting_data", phase_started_at=1000.0
    )
    assert pd.trainer_hangs([busy, waiting], 1100.0, CFG) == []
    [finding] = pd.trainer_hangs([busy, waiting], 1121.0, CFG)
    assert finding.instance_id == "t0" and "forward_backward" in finding.evidence


def test_a_collective_hang_names_the_rank_that_never_entered() -> None:
    ranks = [
        pd.Signals(
            role="trainer",
            instance_id=f"t{i}",
            job_id="j",
            rank=i,
            phase="collective",
            phase_started_at=0.0,
            counters={"collective_seq": 7.0},
        )
        for i in range(3)
    ]
    ranks[2].phase, ranks[2].counters = "forward_backward", {"collective_seq": 6.0}
    assert pd.collective_hangs(ranks, 20.0, CFG) == []
    [finding] = pd.collective_hangs(ranks, 31.0, CFG)
    assert (finding.instance_id, finding.rank) == ("t2", 2)
    assert "#7" in finding.evidence and "rank 2 has not entered" in finding.evidence


def test_non_finite_is_reported_once_per_occurrence_with_where() -> None:
    t = pd.Signals(role="trainer", instance_id="t0", counters={"nonfinite_loss": 1.0, "step": 12.0})
    [finding] = pd.evaluate([t], 0.0, CFG)
    assert "loss at step 12" in finding.evidence
    pd.mark_reported(t, finding)
    assert pd.evaluate([t], 0.0, CFG) == []
    t.counters["nonfinite_loss"] = 2.0
    assert len(pd.evaluate([t], 0.0, CFG)) == 1


def test_a_member_silent_on_an_open_stream_is_probed_until_settled() -> None:
    r = rollout()
    beat(r, 0.0, tokens=1, in_flight=0)
    assert pd.evaluate([r], 2.9, CFG) == []
    [finding] = pd.evaluate([r], 3.0, CFG)
    assert finding.kind == "SILENT" and finding.needs_probe
    # A suspicion is not retired by the detectors; the probe's verdict decides.
    assert pd.evaluate([r], 4.0, CFG)[0].key == finding.key
    beat(r, 4.5, tokens=1, in_flight=0)
    assert pd.evaluate([r], 5.0, CFG) == []


def test_one_trainer_hang_is_reported_once_per_phase_run() -> None:
    t = pd.Signals(role="trainer", instance_id="t0", phase="checkpoint", phase_started_at=100.0)
    t.last_beat_at = 401.0
    [finding] = pd.evaluate([t], 401.0, CFG)
    pd.mark_reported(t, finding)
    assert pd.evaluate([t], 402.0, CFG) == []
    t.phase_started_at, t.last_beat_at = 500.0, 801.0  # the next checkpoint: a new episode
    assert pd.evaluate([t], 801.0, CFG)[0].kind == "TRAINER_HANG"


def test_degraded_needs_peers_and_a_large_gap() -> None:
    peers = [rollout(f"r{i}") for i in range(4)]
    for p, rate in zip(peers, [100.0, 110.0, 90.0, 20.0], strict=True):
        beat(p, 0.0, tokens=1, in_flight=1, rate=rate)
    [finding] = pd.degraded(peers, CFG)
    assert finding.instance_id == "r3"
    assert pd.degraded(peers[2:], CFG) == []


def test_a_rank_frozen_inside_the_collective_the_others_wait_in_is_named() -> None:
    ranks = []
    for rank in (0, 1):
        r = pd.Signals(role="trainer", instance_id=f"t{rank}", job_id="j", rank=rank)
        pd.observe(
            r, phase="collective", phase_started_at=100.0, counters={"collective_seq": 9}, now=100.0
        )
        ranks.append(r)
    pd.observe(
        ranks[0],
        phase="collective",
        phase_started_at=100.0,
        counters={"collective_seq": 9},
        now=140.0,
    )
    [finding] = pd.collective_hangs(ranks, 140.0, CFG)
    assert finding.rank == 1 and "stopped beating inside it" in finding.evidence


def test_a_rank_bound_in_the_registry_but_stopped_before_its_first_beat_as_rank_is_named() -> None:
    waiting = pd.Signals(role="trainer", instance_id="t0", job_id="j", rank=0)
    pd.observe(
        waiting, phase="collective", phase_started_at=0.0, counters={"collective_seq": 3}, now=0.0
    )
    # Its last beat was sent while it was free; the registry says the coordinator bound it.
    frozen = pd.Signals(role="trainer", instance_id="t1", assigned_job="j", assigned_rank=1)
    pd.observe(frozen, phase="idle", phase_started_at=0.0, counters={}, now=0.0)
    other_job = pd.Signals(role="trainer", instance_id="t2", assigned_job="k", assigned_rank=1)
    assert pd.collective_hangs([waiting, frozen, other_job], 29.0, CFG) == []
    [finding] = pd.collective_hangs([waiting, frozen, other_job], 31.0, CFG)
    assert (finding.instance_id, finding.job_id, finding.rank) == ("t1", "j", 1)
    assert "ranks [0] have waited 31.0s in collective #3" in finding.evidence
    assert "rank 1 has sent no beat as a rank of the job" in finding.evidence


def test_the_registry_record_gives_the_signals_their_job_and_rank() -> None:
    views: d.Views = {}
    d.on_registered(views, "trainer", "t1", 4, 0.0, "h:1", "j", lease=7, rank=1)
    signals = views["t1"].progress()
    assert (signals.assigned_job, signals.assigned_rank) == ("j", 1)
    d.on_registered(views, "trainer", "t1", 4, 1.0, "h:1", "", lease=7)  # released
    assert (signals.assigned_job, signals.assigned_rank) == ("", 0)
