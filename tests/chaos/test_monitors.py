"""Two monitors share the beats; one is killed mid-job and detection goes on, against real
processes: what begins while its members move to the other is reported by that one, once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from robustrl.core.assignment import assignment_key, owner
from robustrl.v1 import monitor_pb2, monitor_pb2_grpc
from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, chaos
from tests.support.detection import (
    PROBE_DEADLINE,
    PROBE_WAIT,
    SILENCE,
    SLACK,
    TTL,
    detection_stack,
    incidents,
    member,
    step_of,
    wait_for_incident,
)
from tests.support.recovery import end_after_recoveries, finish, pids, recoveries, submit

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

MONITORS = ["monitor-0", "monitor-1"]
MONITOR_KILLED_STEPS = 360
"""A ceiling: the handover (up to the TTL, 8 s) and a hung rollout's replacement (~105 steps)
fit on a loaded machine; once its recoveries are done the job is ended a few steps later."""


def job_watched_with(instance_id: str) -> str:
    """A job id whose trainer the same monitor watches as `instance_id`: killing that monitor
    moves both, so the NaN and the hang below both cross the handover."""
    for n in range(1000):
        job = f"mk{n}"
        if owner(assignment_key("trainer", "trainer-0", job), MONITORS) == owner(
            instance_id, MONITORS
        ):
            return job
    raise AssertionError("no such job id")  # 1000 tries at a coin flip each


def beats_to(address: object, instance_id: str, since: float) -> bool:
    """Whether the monitor at `address` watches `instance_id` and had a beat from it after
    `since`. The address is read once, before the wait: a `robustrl members` per poll is a cold
    process start (seconds on a loaded machine), which the measured wait would count."""
    with grpc.insecure_channel(str(address)) as channel:
        reply = monitor_pb2_grpc.MonitorStub(channel).GetHealth(
            monitor_pb2.GetHealthRequest(page_size=1000), timeout=5
        )
    seen = {m.instance_id: m.last_seen.ToNanoseconds() / 1e9 for m in reply.members}
    return seen.get(instance_id, 0.0) > since


def replaced(cli: Cli, job: str) -> bool:
    return any(r["kind"] == "ROLLOUT_HANG" and r["done_at"] for r in recoveries(cli, job))


def test_a_monitor_killed_mid_job_hands_its_members_over_and_misses_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    with detection_stack(tmp_path, "--monitors", "2") as stack:
        job = job_watched_with("rollout-0")
        victim = owner("rollout-0", MONITORS)
        assert victim is not None
        [survivor] = [m for m in MONITORS if m != victim]
        submit(stack, model_dir, job, f"trainer.steps={MONITOR_KILLED_STEPS}")
        started = pids(stack, victim, "rollout-0")
        addresses = {m: member(stack, m)["address"] for m in MONITORS}
        before = time.time()
        eventually_sync(lambda: beats_to(addresses[victim], "rollout-0", before), timeout=30)
        eventually_sync(lambda: step_of(stack, job) >= 3, timeout=180)

        os.kill(started[victim], signal.SIGKILL)
        # While the victim is still registered (its lease runs out within the TTL), its members
        # beat to nobody: a NaN of the trainer now is seen by the survivor once they move.
        [nan] = chaos(stack, job, "--fault", "nan", "--role", "trainer")
        assert nan["fault"] == "nan"
        eventually_sync(
            lambda: all(m["instance_id"] != victim for m in stack.members()), timeout=TTL + 5
        )
        left_at = time.time()
        # Its members move as soon as it is out of the registry (they ask etcd each retry).
        moved = eventually_sync(
            lambda: beats_to(addresses[survivor], "rollout-0", left_at), timeout=10
        )

        os.kill(started["rollout-0"], signal.SIGSTOP)
        stopped_at = time.time()
        try:
            hang = wait_for_incident(stack, "ROLLOUT_HANG", "rollout-0", timeout=30)
            eventually_sync(lambda: replaced(stack, job), timeout=120)
        finally:
            os.kill(started["rollout-0"], signal.SIGCONT)
        took = hang["detected_at"] - stopped_at
        bound = SILENCE + PROBE_WAIT + PROBE_DEADLINE + SLACK
        assert took <= bound, f"hang reported {took:.1f}s after SIGSTOP (bound {bound:.1f}s)"
        assert moved <= 5.0, f"rollout-0 moved {moved:.1f}s after its monitor left the registry"

        steps = end_after_recoveries(stack, job)
        finish(stack, job)
        kinds = sorted(i["kind"] for i in incidents(stack, job))
        assert kinds == ["NON_FINITE", "ROLLOUT_HANG"], kinds  # each once, by one monitor
        assert_nothing_lost_or_trained_twice(stack, job, tmp_path / "runs" / job, steps_run=steps)
