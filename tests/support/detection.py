"""A local stack with fast detection settings, and reading what its monitor reported."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import eventually_sync
from tests.support.cli import Cli
from tests.support.paths import EXAMPLE

TTL = 8.0


SILENCE = 2.0


PROBE_WAIT = 1.0


PROBE_DEADLINE = 2.0


EVALUATE = 0.2


COLLECTIVE_BUDGET = 2.0


RANKS_SILENCE = 6.0
"""The monitor's silence window in the stacks that stop a trainer rank (SILENCE elsewhere). A
stopped rank goes silent as rank 0 enters the collective it misses once its next batch comes;
the collective's budget must run out before the silence window and its probe would report the
rank as a TRAINER_HANG. With SILENCE, rank 0 waiting a few seconds for its batch (rollouts on a
loaded host) lost that race."""


LEDGER_PAGE_SIZE = 4


#: Beats are 0.5 s apart; one beat's lag plus an evaluation round is the slack on top of a bound.
SLACK = 0.5 + 2 * EVALUATE


DETECTION_ENV = {
    "ROBUSTRL_ETCD_SESSION_TTL": str(int(TTL)),
    "ROBUSTRL_MONITOR_SILENCE_WINDOW": str(SILENCE),
    "ROBUSTRL_MONITOR_PROBE_WAIT": str(PROBE_WAIT),
    "ROBUSTRL_MONITOR_PROBE_DEADLINE": str(PROBE_DEADLINE),
    "ROBUSTRL_MONITOR_EVALUATE_INTERVAL": str(EVALUATE),
    "ROBUSTRL_MONITOR_COLLECTIVE_BUDGET": str(COLLECTIVE_BUDGET),
    # Small pages, so that these jobs move dropped groups and take-backs out of the ledger.
    "ROBUSTRL_COORDINATOR_LEDGER_PAGE_SIZE": str(LEDGER_PAGE_SIZE),
}


@contextlib.contextmanager
def detection_stack(
    tmp_path: Path, *up_args: str, env: dict[str, str] | None = None
) -> Iterator[Cli]:
    """A local stack (1 trainer, 2 rollouts) with fast detection settings (and `env`); `down`
    at the end."""
    cli = Cli(tmp_path / "home")
    cli.env.update(DETECTION_ENV)
    cli.env.update(env or {})
    cli.env["ROBUSTRL_TRAINER_RUNS_DIR"] = str(tmp_path / "runs")
    cli.run("up", "--trainers", "1", "--rollouts", "2", *up_args)
    try:
        yield cli
    finally:
        cli.run("down", check=False)


def submit(cli: Cli, model_dir: Path, job: str, *overrides: str) -> None:
    cli.run(
        "submit",
        str(EXAMPLE),
        "--id",
        job,
        f"model.path={model_dir}",
        "trainer.groups_per_step=8",
        "trainer.eval_every=1000",
        *overrides,
    )


def incidents(cli: Cli, job: str = "") -> list[dict[str, Any]]:
    out = cli.json("incidents", *([job] if job else []))
    assert isinstance(out, list)
    return out


def member(cli: Cli, instance_id: str) -> dict[str, Any]:
    return next(m for m in cli.members() if m["instance_id"] == instance_id)


def step_of(cli: Cli, job: str) -> int:
    return int(cli.status(job)["step"])


def wait_for_incident(cli: Cli, kind: str, instance_id: str, timeout: float) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def reported() -> bool:
        found[:] = [
            i for i in incidents(cli) if i["kind"] == kind and i["instance_id"] == instance_id
        ]
        return bool(found)

    eventually_sync(reported, timeout=timeout, interval=0.2)
    return found[0]


def run_a_fault_free_job_with_long_tails(
    stack: Cli, model_dir: Path, runs: Path, engine: str, steps: int
) -> None:
    """A job that meets what looks like failure but is not, and the stack reports nothing:
    max_staleness 0, so rollouts sit idle waiting for each new version; every step
    checkpoints; every 5th group generates 20x as many tokens as the others (one or two of a
    step's 8 groups). Asserts on the whole stack's incidents: a stack's first job."""
    submit(
        stack,
        model_dir,
        "calm",
        f"rollout.engine={engine}",
        f"trainer.steps={steps}",
        "trainer.max_staleness=0",
        "trainer.checkpoint_every=1",
        "rollout.long_tail_every=5",
        "rollout.long_tail_factor=20",
    )
    watch = stack.run("watch", "calm", check=False, timeout=360)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert incidents(stack) == []
    rows = (runs / "calm" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == steps
