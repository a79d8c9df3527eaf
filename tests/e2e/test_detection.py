"""Role-aware detection against real service processes: each failure is reported within its
bound, by the right kind, naming the right member — and a fault-free run reports nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import eventually_sync
from tests.support.cli import Cli
from tests.support.detection import (
    COLLECTIVE_BUDGET,
    PROBE_DEADLINE,
    PROBE_WAIT,
    RANKS_SILENCE,
    SILENCE,
    SLACK,
    TTL,
    detection_stack,
    incidents,
    member,
    run_a_fault_free_job_with_long_tails,
    step_of,
    submit,
    wait_for_incident,
)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Cli]:
    with detection_stack(tmp_path) as cli:
        yield cli


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_fault_free_run_with_long_tails_checkpoints_and_idle_rollouts_has_no_incident(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    run_a_fault_free_job_with_long_tails(stack, model_dir, tmp_path / "runs", "torch", 12)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_of_a_rollout_and_of_the_trainer_are_reported_within_the_ttl(
    stack: Cli, model_dir: Path
) -> None:
    submit(stack, model_dir, "crash", "trainer.steps=500")
    eventually_sync(lambda: step_of(stack, "crash") >= 2, timeout=120)
    for victim in ("rollout-1", "trainer-0"):
        pid = int(member(stack, victim)["pid"])
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        incident = wait_for_incident(stack, "MEMBER_LOST", victim, timeout=TTL + 5)
        took = incident["detected_at"] - killed_at
        assert took <= TTL + 1.0, f"{victim}: reported {took:.1f}s after kill -9"
        assert incident["job_id"] == "crash"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_generating_rollout_is_a_rollout_hang_after_the_window_and_the_probe(
    stack: Cli, model_dir: Path
) -> None:
    # Long generations keep the rollout generating most of the time.
    submit(stack, model_dir, "hang", "trainer.steps=500", "rollout.max_new_tokens=32")
    eventually_sync(lambda: step_of(stack, "hang") >= 1, timeout=120)
    victim = member(stack, "rollout-0")
    pid = int(victim["pid"])

    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        incident = wait_for_incident(stack, "ROLLOUT_HANG", "rollout-0", timeout=TTL)
    finally:
        os.kill(pid, signal.SIGCONT)
    took = incident["detected_at"] - stopped_at
    bound = SILENCE + PROBE_WAIT + PROBE_DEADLINE + SLACK
    assert took <= bound, f"reported {took:.1f}s after SIGSTOP (bound {bound:.1f}s)"
    assert "probe" in incident["evidence"]
    assert [i["kind"] for i in incidents(stack)] == ["ROLLOUT_HANG"]  # one failure, one incident


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_nan_loss_is_reported_in_the_step_it_happens(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    submit(stack, model_dir, "nan", "trainer.steps=8", "faults.nan_loss_steps=[4]")
    incident = wait_for_incident(stack, "NON_FINITE", "trainer-0", timeout=180)
    assert "loss at step 4" in incident["evidence"] and incident["rank"] == 0
    watch = stack.run("watch", "nan", check=False, timeout=180)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "nan" / "metrics.jsonl").read_text().splitlines()
    ]
    step_5_done = next(r["time"] for r in rows if r["step"] == 5)
    assert incident["detected_at"] < step_5_done, "reported after the next step finished"
    assert [i["kind"] for i in incidents(stack, "nan")] == ["NON_FINITE"]


@pytest.fixture
def two_trainers(tmp_path: Path) -> Iterator[Cli]:
    env = {"ROBUSTRL_MONITOR_SILENCE_WINDOW": str(RANKS_SILENCE)}
    with detection_stack(tmp_path, "--trainers", "2", env=env) as cli:
        yield cli


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["at-bind", "mid-job"])
def test_a_stopped_trainer_rank_is_named_by_a_collective_hang(
    two_trainers: Cli, model_dir: Path, when: str
) -> None:
    stack = two_trainers
    submit(stack, model_dir, "ranks", "trainer.steps=500", "trainer.world_size=2")
    if when == "at-bind":
        # Before its first beat as rank 1 of the job, while rank 0 waits for the group to
        # form: the monitor knows it is rank 1 from its registry record.
        eventually_sync(lambda: member(stack, "trainer-1")["job_id"] == "ranks", timeout=180)
    else:
        # Some steps past the ranks' start: inside the job's collectives.
        eventually_sync(lambda: step_of(stack, "ranks") >= 8, timeout=180)
    rank1 = member(stack, "trainer-1")
    assert (rank1["job_id"], rank1["rank"]) == ("ranks", 1)
    pid = int(rank1["pid"])
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        incident = wait_for_incident(stack, "COLLECTIVE_HANG", "trainer-1", timeout=TTL)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (incident["job_id"], incident["rank"]) == ("ranks", 1), incident
    assert "rank 1" in incident["evidence"]
    # Named once rank 0 has waited the collective's budget in the collective rank 1 misses
    # (which rank 0 enters when its next batch comes: a moment, or seconds on a loaded host).
    waited = re.search(r"have waited ([0-9.]+)s", incident["evidence"])
    assert waited is not None, incident["evidence"]
    bound = COLLECTIVE_BUDGET + SLACK
    assert float(waited[1]) <= bound, f"{incident['evidence']} (bound {bound:.1f}s)"
    assert incident["detected_at"] - stopped_at <= TTL
    assert [i["kind"] for i in incidents(stack)] == ["COLLECTIVE_HANG"]
