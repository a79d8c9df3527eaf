"""Jobs whose rollouts run vLLM (its CPU build) through real service processes, one after
another on one stack (a vLLM engine takes the better part of a minute to start here, a stack
a while too): a fault-free job with long tails reports nothing, input vLLM cannot serve fails
its job and nothing else, a job goes on through a rollout killed -9 and another rollout's engine
core stopped while the service beats on, and an engine core that dies crashes its rollout.
Each test leaves the stack usable by the next; the destructive ones come last."""

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
    run_a_fault_free_job_with_long_tails,
    step_of,
    submit,
    wait_for_incident,
)
from tests.support.recovery import LONG_STEPS, end_after

pytestmark = [pytest.mark.slow]

HANG_WINDOW = 6.0
"""The monitor's rollout hang window in these tests (10 s by default)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """One stack for the file's tests, in their order (`--dist loadfile` keeps a file on one
    worker): each leaves it with free rollouts for the next job."""
    env = {"ROBUSTRL_MONITOR_ROLLOUT_HANG_WINDOW": str(HANG_WINDOW)}
    with detection_stack(tmp_path_factory.mktemp("vllm"), env=env) as cli:
        yield cli


def runs(cli: Cli) -> Path:
    """Where the stack's trainers write each job's run."""
    return Path(cli.env["ROBUSTRL_TRAINER_RUNS_DIR"])


def submit_vllm(cli: Cli, model_dir: Path, job: str, *overrides: str) -> None:
    """`submit` of the detection tests (8 groups a step, no eval), with rollouts on vLLM."""
    submit(cli, model_dir, job, "rollout.engine=vllm", *overrides)


def rollouts_of(cli: Cli, job: str) -> list[str]:
    return sorted(
        str(m["instance_id"])
        for m in cli.members()
        if m["role"] == "rollout" and m["job_id"] == job
    )


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


@pytest.mark.timeout(400)
def test_a_fault_free_run_with_long_tails_checkpoints_and_idle_rollouts_has_no_incident(
    stack: Cli, model_dir: Path
) -> None:
    # The stack's first job: none before it to have reported anything. vLLM's long tails take
    # ~10 s a step here: fewer steps than test_detection's torch run.
    run_a_fault_free_job_with_long_tails(stack, model_dir, runs(stack), "vllm", 4)


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


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_a_vllm_job_goes_on_through_a_killed_rollout_and_a_hung_engine_and_loses_nothing(
    stack: Cli, model_dir: Path
) -> None:
    # Ended a few steps past both recoveries. That vLLM learns is not this test's: its
    # samples and logprobs are the torch engine's (test_vllm_engine), whose jobs learn
    # (test_rl_job, `make demo`); decision 0022.
    submit_vllm(stack, model_dir, "vl", f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(stack, "vl") >= 5, timeout=240)
    first, second = rollouts_of(stack, "vl")
    rollout_0 = int(member(stack, first)["pid"])
    engine_0 = engine_pid(stack, first)

    # The engine core alone stops: the rollout service lives and beats, its tokens stop.
    [hang] = chaos(stack, "vl", "--fault", "hang", "--engine", "--instance", first)
    assert (hang["pid"], hang["process"]) == (engine_0, "engine")
    incident = wait_for_incident(stack, "ROLLOUT_HANG", first, timeout=30)
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
    pid, engine = int(member(stack, second)["pid"]), engine_pid(stack, second)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    lost = wait_for_incident(stack, "MEMBER_LOST", second, timeout=TTL + 5)
    assert lost["detected_at"] - killed_at <= TTL + 1.0
    eventually_sync(lambda: ended(engine), timeout=15)

    steps = end_after(stack, "vl", lambda: recovery_done(stack, "vl", 2), timeout=400)
    watch = stack.run("watch", "vl", check=False, timeout=600)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    run = runs(stack) / "vl"
    assert_nothing_lost_or_trained_twice(stack, "vl", run, steps)
    # Every trajectory names the version it was made with, each within the staleness bound.
    for line in (run / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for detail in entry["groups"].values():
            assert all(0 <= entry["step"] - v <= 1 for v in detail["versions"]), entry
    logs = stack.home / "logs"
    assert "rollout.weights_loaded" in (logs / f"{first}.log").read_text()


@pytest.mark.chaos
@pytest.mark.timeout(400)
def test_an_engine_core_that_dies_crashes_its_rollout_which_is_recovered_as_lost(
    stack: Cli, model_dir: Path
) -> None:
    # One rollout is enough to lose: the job starts one engine, not two.
    submit_vllm(stack, model_dir, "dies", "trainer.steps=1000", "rollout.replicas=1")
    eventually_sync(lambda: step_of(stack, "dies") >= 2, timeout=240)
    [victim] = rollouts_of(stack, "dies")
    rollout = int(member(stack, victim)["pid"])

    [kill] = chaos(stack, "dies", "--fault", "kill", "--engine", "--instance", victim)
    assert kill["process"] == "engine"
    lost = wait_for_incident(stack, "MEMBER_LOST", victim, timeout=TTL + 5)
    # The rollout noticed within its watch interval and crashed: its address refused at once.
    assert lost["detected_at"] - kill["at"] <= 3.0, lost
    eventually_sync(lambda: ended(rollout), timeout=10)
    # Mid-generation the batch fails, idle the watch sees it: a crash that says how it died.
    crash = (stack.home / "logs" / f"{victim}.log").read_text()
    assert "rollout.crashed" in crash and "exited with signal 9" in crash
    # ... and is recovered as any lost rollout (its replacement's start is the other test's).
    eventually_sync(lambda: bool(stack.status("dies")["recoveries"]), timeout=30)
    [recovery] = stack.status("dies")["recoveries"]
    assert recovery["actions"] == [
        f"FENCE {victim}",
        f"REQUEUE {victim}",
        f"REPLACE_ROLLOUT {victim}",
    ]
    stack.run("cancel", "dies")
