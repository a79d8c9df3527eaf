"""Driving a job through a recovery on a local stack: submit it, read its recoveries and its
members' pids, end it a few steps after the recovery under test (`robustrl update`), watch it
succeed; a job that must ride out trouble with no recovery at all; and the stack's member logs
read from a mark, for stacks that several tests share."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robustrl.contracts.errors import Unavailable
from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli
from tests.support.detection import incidents, step_of
from tests.support.paths import EXAMPLE
from tests.support.processes import exited

STEPS = 80
"""A job's budget unless a test says otherwise."""

LONG_STEPS = 5000
"""The budget of a job that is ended relative to its recovery (`end_after`): far beyond any
recovery on two busy cores (~10 steps a second), so that no job ends before its recovery
completes, and lowered once it has."""

PAST_RECOVERY = 5
"""Steps the job must make after its recovery completed before it is ended: it trains on."""

AHEAD = 25
"""How far ahead of the step it is at a job's budget is put to end it: what the job still
trains after the update, covering the CLI process's start (a second or two here)."""

ROLLOUT_1_REPLACED = ["FENCE rollout-1", "REQUEUE rollout-1", "REPLACE_ROLLOUT rollout-1"]
"""The recovery of a lost rollout-1: fenced, its leases taken back, a new rollout asked for."""


def submit(cli: Cli, model_dir: Path, job: str, *overrides: str) -> None:
    cli.run(
        "submit",
        str(EXAMPLE),
        "--id",
        job,
        f"model.path={model_dir}",
        f"trainer.steps={STEPS}",
        "trainer.groups_per_step=8",
        "trainer.eval_every=1000",
        *overrides,
    )


def finish(cli: Cli, job: str) -> dict[str, Any]:
    watch = cli.run("watch", job, check=False, timeout=360)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    status = cli.json("status", job)
    assert isinstance(status, dict) and status["phase"] == "SUCCEEDED", status
    return status


def recoveries(cli: Cli, job: str) -> list[dict[str, Any]]:
    status = cli.json("status", job)
    assert isinstance(status, dict)
    return list(status["recoveries"])


def pids(cli: Cli, *instance_ids: str) -> dict[str, int]:
    """These members' pids, read in one command. Tests read them before they wait for the job's
    step: every command is a cold process start (seconds on two busy cores, ~10 steps a
    second), and a job of STEPS once ended between the wait and the fault."""
    members = {m["instance_id"]: m for m in cli.members()}
    return {name: int(str(members[name]["pid"])) for name in instance_ids}


def data_plane_pids(cli: Cli) -> dict[object, object]:
    """Trainer and rollout members by instance id -> their pid, the living ones: on a stack that
    earlier tests used, a member they killed stays registered until its lease lapses."""
    return {
        m["instance_id"]: m["pid"]
        for m in cli.members()
        if m["role"] in ("trainer", "rollout") and not exited(int(str(m["pid"])))
    }


def wait_for_job_incident(
    cli: Cli, job: str, kind: str, instance_id: str, timeout: float
) -> dict[str, Any]:
    """The first `kind` incident about `instance_id` in `job`, once reported: on a stack that
    earlier tests used, the same member's incidents in their jobs are not this one."""
    found: list[dict[str, Any]] = []

    def reported() -> bool:
        found[:] = [
            i for i in incidents(cli, job) if i["kind"] == kind and i["instance_id"] == instance_id
        ]
        return bool(found)

    eventually_sync(reported, timeout=timeout, interval=0.2)
    return found[0]


def recovered(cli: Cli, job: str, count: int = 1) -> bool:
    """The job has `count` recoveries (or more), each completed."""
    recs = recoveries(cli, job)
    return len(recs) >= count and all(r["done_at"] for r in recs)


def readable(predicate: Callable[[], bool]) -> Callable[[], bool]:
    """`predicate`, false while no coordinator can be read (one registers again after an etcd
    outage, or takes over from a leader that was killed) instead of raising."""

    def tolerant() -> bool:
        try:
            return predicate()
        except Unavailable:
            return False

    return tolerant


def end_soon(cli: Cli, job: str, ahead: int = AHEAD) -> int:
    """Lower the job's budget to `ahead` steps beyond the step it is at (`robustrl update`);
    the new budget, or the job's own where that ends it sooner. Refused when the job passed
    that step while the command started (a loaded machine): asked again from the step the
    refusal names, twice as far ahead."""
    status = cli.status(job)
    step, budget = int(status["step"]), int(status["spec"]["trainer"]["steps"])
    for _ in range(6):
        steps = step + ahead
        if steps >= budget:
            return budget  # it ends as soon by its own budget: an update would only lengthen it
        update = cli.run("update", job, f"trainer.steps={steps}", "--json", check=False)
        if update.returncode == 0:
            updated = json.loads(update.stdout)  # the job as `update --json` prints it
            assert updated["spec"]["trainer"]["steps"] == steps, updated
            return steps
        passed = re.search(r"is at\s+step\s+(\d+):", update.stderr)
        assert passed, update.stderr
        step, ahead = int(passed.group(1)), 2 * ahead
    raise AssertionError(f"job {job} kept passing the budgets asked for it")


def end_after(
    cli: Cli,
    job: str,
    done: Callable[[], bool],
    *,
    past: int = PAST_RECOVERY,
    timeout: float = 180,
) -> int:
    """Once `done` (the recovery under test has completed) and the job trained `past` steps
    since, end it `AHEAD` steps on (`end_soon`); its budget now."""
    eventually_sync(readable(done), timeout=timeout)
    eventually_sync(readable(lambda: step_of(cli, job) >= 0), timeout=timeout)
    since = step_of(cli, job)
    eventually_sync(readable(lambda: step_of(cli, job) >= since + past), timeout=timeout)
    return end_soon(cli, job)


def end_after_recoveries(cli: Cli, job: str, count: int = 1) -> int:
    """`end_after` the job's `count` recoveries have completed."""
    return end_after(cli, job, lambda: recovered(cli, job, count))


def ride_out(cli: Cli, model_dir: Path, job: str, trouble: Callable[[], None]) -> LogMark:
    """Submit `job`, make `trouble` once it reaches step 8, and check that the job rode it out:
    it trained on after it, and succeeded with the same trainer and rollouts, no incident and no
    recovery, nothing lost or trained twice. The stack's logs from before the job."""
    mark = LogMark(cli)
    submit(cli, model_dir, job, f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(cli, job) >= 8, timeout=180)
    data_plane = data_plane_pids(cli)
    trouble()
    steps = end_after(cli, job, lambda: True)
    finish(cli, job)
    assert incidents(cli, job) == []
    assert recoveries(cli, job) == []
    assert data_plane_pids(cli) == data_plane
    assert_nothing_lost_or_trained_twice(cli, job, runs_of(cli) / job, steps_run=steps)
    return mark


def cancel_unfinished(cli: Cli) -> None:
    """Cancel every job of the stack that has not ended."""
    for job in cli.jobs():
        if job["phase"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            cli.run("cancel", job["job_id"], "--reason", "its test ended first", check=False)


def runs_of(cli: Cli) -> Path:
    """The folder the stack's trainers keep their job runs in (`detection_stack`)."""
    return Path(cli.env["ROBUSTRL_TRAINER_RUNS_DIR"])


class LogMark:
    """The stack's member logs as they are now: `since` reads what was written after. A test
    on a stack that earlier tests used reads only its own lines."""

    def __init__(self, cli: Cli) -> None:
        self.logs = cli.home / "logs"
        self.sizes = {p.name: p.stat().st_size for p in self.logs.glob("*.log")}

    def since(self, name: str) -> str:
        """What log `name` (e.g. "trainer-0.log") got after the mark; a log started since, whole."""
        with (self.logs / name).open("rb") as log:
            log.seek(self.sizes.get(name, 0))
            return log.read().decode(errors="replace")

    def since_all(self, pattern: str) -> str:
        """What the logs matching `pattern` (e.g. "coordinator-*.log") got after the mark."""
        return "".join(self.since(p.name) for p in sorted(self.logs.glob(pattern)))
