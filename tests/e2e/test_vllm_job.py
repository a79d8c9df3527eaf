"""Jobs whose rollouts run vLLM (its CPU build) through real service processes: one learns
through a rollout killed -9 and another rollout's engine core stopped while the service beats
on, an engine core that dies crashes its rollout, and input vLLM cannot serve fails the job and
nothing else. (A fault-free vLLM job with long tails is test_detection's.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from robustrl.contracts.members import ENGINE_PID_LABEL
from robustrl.core.processes import descendants, process_name
from robustrl.generation.modelgen import ModelShape, init_model
from tests.support import eventually_sync, process_state
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, chaos
from tests.support.detection import (
    PROBE_DEADLINE,
    PROBE_WAIT,
    SLACK,
    TTL,
    detection_stack,
    incidents,
    member,
    step_of,
    submit,
    wait_for_incident,
)

pytestmark = [pytest.mark.slow]

HANG_WINDOW = 6.0
"""The monitor's rollout hang window in these tests (10 s by default)."""

LEARN_STEPS = 200
GROUPS_PER_STEP = 64
EVAL_GAIN = 0.3
"""The least rise of the held-out eval reward over LEARN_STEPS (measured without faults: +0.30
at step 150)."""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Cli]:
    env = {"ROBUSTRL_MONITOR_ROLLOUT_HANG_WINDOW": str(HANG_WINDOW)}
    with detection_stack(tmp_path, env=env) as cli:
        yield cli


def submit_vllm(cli: Cli, model_dir: Path, job: str, *overrides: str) -> None:
    """`submit` of the detection tests (8 groups a step, no eval), with rollouts on vLLM."""
    submit(cli, model_dir, job, "rollout.engine=vllm", *overrides)


def engine_pid(cli: Cli, instance_id: str) -> int:
    labels = member(cli, instance_id)["labels"]
    assert isinstance(labels, dict) and ENGINE_PID_LABEL in labels, labels
    return int(labels[ENGINE_PID_LABEL])


def ended(pid: int) -> bool:
    """Gone, or a zombie: nothing of it runs."""
    try:
        return process_state(pid) == "Z"
    except OSError:
        return True


def vllm_processes_under(pid: int) -> list[int]:
    """vLLM's processes (VLLM::EngineCore, VLLM::Worker) among pid's descendants, still running."""
    return [
        child
        for child in descendants(pid)
        if process_name(child).startswith("VLLM::") and not ended(child)
    ]


def recovery_done(cli: Cli, job: str, count: int) -> bool:
    recoveries: list[dict[str, Any]] = cli.status(job)["recoveries"]
    return len(recoveries) >= count and all(r["done_at"] for r in recoveries)


@pytest.mark.chaos
@pytest.mark.timeout(900)  # 3-4 min here, 5-9 under the suite: five vLLM engine starts
def test_a_vllm_job_learns_through_a_killed_rollout_and_a_hung_engine_and_loses_nothing(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    submit_vllm(
        stack,
        model_dir,
        "vl",
        f"trainer.steps={LEARN_STEPS}",
        f"trainer.groups_per_step={GROUPS_PER_STEP}",
        "trainer.eval_every=25",
    )
    eventually_sync(lambda: step_of(stack, "vl") >= 5, timeout=240)
    rollout_0 = int(member(stack, "rollout-0")["pid"])
    engine_0 = engine_pid(stack, "rollout-0")

    # The engine core alone stops: the rollout service lives and beats, its tokens stop.
    [hang] = chaos(stack, "vl", "--fault", "hang", "--engine", "--instance", "rollout-0")
    assert (hang["pid"], hang["process"]) == (engine_0, "engine")
    incident = wait_for_incident(stack, "ROLLOUT_HANG", "rollout-0", timeout=30)
    took = incident["detected_at"] - hang["at"]
    bound = HANG_WINDOW + PROBE_WAIT + PROBE_DEADLINE + SLACK
    assert took <= bound, f"reported {took:.1f}s after the engine stopped (bound {bound:.1f}s)"
    assert "probe" in incident["evidence"]
    # Never lost: the service answered all along. Fenced, it closed its engine and stays up.
    assert [i["kind"] for i in incidents(stack, "vl")] == ["ROLLOUT_HANG"]
    eventually_sync(lambda: ended(engine_0), timeout=30)
    assert not ended(rollout_0)

    # kill -9 of the other vLLM rollout while the first is being replaced: lost, and its
    # engine's processes die with it. The job has no rollout of its own left: it ends only
    # if both are replaced.
    pid, engine = int(member(stack, "rollout-1")["pid"]), engine_pid(stack, "rollout-1")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    lost = wait_for_incident(stack, "MEMBER_LOST", "rollout-1", timeout=TTL + 5)
    assert lost["detected_at"] - killed_at <= TTL + 1.0
    eventually_sync(lambda: ended(engine), timeout=15)

    watch = stack.run("watch", "vl", check=False, timeout=600)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert recovery_done(stack, "vl", 2)
    run = tmp_path / "runs" / "vl"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    assert evals[-1] >= evals[0] + EVAL_GAIN, f"eval reward did not rise enough: {evals}"
    assert_nothing_lost_or_trained_twice(stack, "vl", run, LEARN_STEPS, GROUPS_PER_STEP)
    # Every trajectory names the version it was made with, each within the staleness bound.
    for line in (run / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for detail in entry["groups"].values():
            assert all(0 <= entry["step"] - v <= 1 for v in detail["versions"]), entry
    logs = stack.home / "logs"
    assert "rollout.weights_loaded" in (logs / "rollout-0.log").read_text()


@pytest.mark.chaos
@pytest.mark.timeout(400)
def test_an_engine_core_that_dies_crashes_its_rollout_which_is_recovered_as_lost(
    stack: Cli, model_dir: Path
) -> None:
    submit_vllm(stack, model_dir, "dies", "trainer.steps=1000")
    eventually_sync(lambda: step_of(stack, "dies") >= 2, timeout=240)
    rollout = int(member(stack, "rollout-0")["pid"])

    [kill] = chaos(stack, "dies", "--fault", "kill", "--engine", "--instance", "rollout-0")
    assert kill["process"] == "engine"
    lost = wait_for_incident(stack, "MEMBER_LOST", "rollout-0", timeout=TTL + 5)
    # The rollout noticed within its watch interval and crashed: its address refused at once.
    assert lost["detected_at"] - kill["at"] <= 3.0, lost
    eventually_sync(lambda: ended(rollout), timeout=10)
    # Mid-generation the batch fails, idle the watch sees it: a crash that says how it died.
    crash = (stack.home / "logs" / "rollout-0.log").read_text()
    assert "rollout.crashed" in crash and "exited with signal 9" in crash
    # ... and is recovered as any lost rollout (its replacement's start is the other test's).
    eventually_sync(lambda: bool(stack.status("dies")["recoveries"]), timeout=30)
    [recovery] = stack.status("dies")["recoveries"]
    assert recovery["actions"] == [
        "FENCE rollout-0",
        "REQUEUE rollout-0",
        "REPLACE_ROLLOUT rollout-0",
    ]
    stack.run("cancel", "dies")


@pytest.mark.timeout(400)
def test_input_vllm_cannot_serve_fails_the_job_and_the_rollouts_stay_up_and_free(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    rollouts = {m["instance_id"]: m["pid"] for m in stack.members() if m["role"] == "rollout"}
    # Heads of 16 dimensions: the trainer's torch runs them, vLLM's CPU attention refuses.
    narrow = init_model(
        tmp_path / "narrow",
        seed=0,
        shape=ModelShape(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2),
    )
    cases = {
        "long": (model_dir, "rollout.max_new_tokens=500", "rollout.max_new_tokens: 500 tokens"),
        "narrow": (narrow, "rollout.temperature=1.0", "Unsupported CPU attention"),
    }
    for job, (model, override, cause) in cases.items():
        submit_vllm(stack, model, job, "trainer.steps=3", override)

        def failed(job: str = job) -> bool:
            return bool(stack.status(job)["phase"] == "FAILED")

        eventually_sync(failed, timeout=180)
        message = stack.status(job)["message"]
        assert cause in message and "rollout" in message, message
    members = {m["instance_id"]: m for m in stack.members()}
    for name, pid in rollouts.items():
        assert members[name]["pid"] == pid and members[name]["job_id"] == "", members[name]
        assert ENGINE_PID_LABEL not in members[name]["labels"]  # type: ignore[operator]
        assert vllm_processes_under(int(str(pid))) == [], name
