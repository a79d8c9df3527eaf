"""`robustrl chaos` against real service processes: the faults it injects are the ones the
monitor reports, on the member it names, and a timed hang comes back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from robustrl.cli.chaos import Chaos, ChaosOptions, plan_schedule
from tests.support import eventually_sync, process_state
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
    submit,
    wait_for_incident,
)

JOB = "chaos"
SCHEDULED_STEPS = 48


def last_step_of_window(window: int, every_pct: int) -> int:
    """The last step of a schedule's `window` (as plan_schedule cuts them, in whole steps)."""
    width = SCHEDULED_STEPS * every_pct // 100
    return min(SCHEDULED_STEPS - 1, (window + 1) * width - 1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """One stack for the module: the second test needs only the trainer the first leaves."""
    with detection_stack(tmp_path_factory.mktemp("chaos")) as cli:
        yield cli


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_chaos_injects_a_nan_and_a_timed_hang_that_the_monitor_reports(
    stack: Cli, model_dir: Path
) -> None:
    # Refused before anything is touched: exit 2 and a line saying why.
    missing = stack.run("chaos", JOB, "--fault", "kill", check=False)
    assert missing.returncode == 2 and f"no job {JOB}" in missing.stderr

    submit(stack, model_dir, JOB, "trainer.steps=500")
    eventually_sync(lambda: step_of(stack, JOB) >= 1, timeout=120)
    for bad, why in [
        (["--fault", "nan", "--role", "rollout"], "only be injected into a trainer"),
        (["--every-pct", "0"], "every-pct"),
        (["--fault", "hang", "--instance", "rollout-9"], "does not serve job"),
    ]:
        refused = stack.run("chaos", JOB, *bad, check=False)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr

    [nan] = chaos(stack, JOB, "--fault", "nan", "--role", "trainer", "--once")
    assert (nan["fault"], nan["instance_id"]) == ("nan", "trainer-0")
    incident = wait_for_incident(stack, "NON_FINITE", "trainer-0", timeout=60)
    assert f"loss at step {nan['step']}" in incident["evidence"]

    pid = int(member(stack, "rollout-1")["pid"])
    # Resumed well after the silence window, the probe's wait and its deadline have passed.
    hang_for = SILENCE + PROBE_WAIT + PROBE_DEADLINE + SLACK + 2.0
    [hang] = chaos(
        stack, JOB, "--fault", "hang", "--instance", "rollout-1", "--hang-for", str(hang_for)
    )
    assert (hang["fault"], hang["pid"]) == ("hang", pid)
    # The command returns after it resumed the process: the zombie is back.
    assert process_state(pid) != "T"

    # Stopped, it stops beating: the silence is probed and the failed probe is its hang, within
    # the lease's TTL. A loss (MEMBER_LOST) is what a crash is reported as; for a process that
    # hung and came back it would mean the hang went undetected until its lease expired.
    seen: list[dict[str, Any]] = []

    def reported() -> bool:
        seen[:] = [i for i in incidents(stack, JOB) if i["instance_id"] == "rollout-1"]
        return bool(seen)

    eventually_sync(reported, timeout=TTL, unmet=lambda: "no incident of rollout-1")
    # Its first: what the zombie does once resumed and fenced may be reported after it.
    assert min(seen, key=lambda i: float(i["detected_at"]))["kind"] == "ROLLOUT_HANG", seen

    # A clean stop (SIGTERM) of a member that serves the job is its loss, reported at once.
    pid = int(member(stack, "rollout-0")["pid"])
    [stop] = chaos(stack, JOB, "--fault", "stop", "--instance", "rollout-0")
    assert (stop["fault"], stop["pid"]) == ("stop", pid)
    lost = wait_for_incident(stack, "MEMBER_LOST", "rollout-0", timeout=SLACK + 5)
    assert "stopped cleanly (a goodbye)" in lost["evidence"]
    stack.run("cancel", JOB)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_a_seeded_schedule_injects_one_fault_per_pct_as_the_job_reaches_each_step(
    stack: Cli, model_dir: Path
) -> None:
    # Steps enough that a poll slowed by a loaded host still finds a step left for each
    # fault: 16 steps of the tiny model could end before the first one was sent (both then
    # went into the last step), and the seed's second fault leaves 20 steps after it.
    submit(stack, model_dir, "sched", f"trainer.steps={SCHEDULED_STEPS}")
    # Submitted just now, so PENDING: a schedule waits for the job to run. Followed from the
    # test's process (the command's own code): a cold CLI start on a loaded host can take the
    # seconds in which the tiny job passes its first half, whose fault is then skipped.
    options = ChaosOptions("sched", ["nan"], ["trainer"], every_pct=50, seed=8)
    followed = stack.reader().call(lambda client: Chaos(client, options, print).run(), timeout=150)
    injected = [asdict(i) for i in followed]
    plan = plan_schedule(SCHEDULED_STEPS, 50, 8, ["nan"], ["trainer"])  # steps 8 and 28
    assert [(i["fault"], i["role"]) for i in injected] == [("nan", "trainer")] * 2
    for window, (done, planned) in enumerate(zip(injected, plan, strict=True)):
        assert done["step"] >= planned.step  # on the planned step, or the next one if late
        # One fault per 50% of the steps: however late, each lands in its own half of the job,
        # never in the next one's nor on the last step (nothing after it to recover into).
        assert done["step"] <= last_step_of_window(window, 50), (window, injected)
    steps = [int(i["step"]) for i in injected]
    assert steps[0] < steps[1]

    def both_reported() -> bool:
        evidence = [i["evidence"] for i in incidents(stack, "sched") if i["kind"] == "NON_FINITE"]
        return all(any(f"loss at step {s} " in e for e in evidence) for s in steps)

    eventually_sync(both_reported, timeout=60)
