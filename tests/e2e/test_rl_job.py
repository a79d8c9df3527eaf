"""A shortened GRPO job through real service processes: it learns, and nothing is lost or
trained twice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import eventually_sync
from tests.support.cli import Cli, etcd_json
from tests.support.paths import EXAMPLE

STEPS = 100
STALENESS = 1


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Cli]:
    cli = Cli(tmp_path / "home")
    cli.env["ROBUSTRL_TRAINER_RUNS_DIR"] = str(tmp_path / "runs")
    # etcd compacts its history every 5 s here (5 min by default), so the job runs with the
    # compactions a long job meets, and any watch more than 5 s behind resumes by resyncing.
    cli.run("up", "--trainers", "1", "--rollouts", "2", "--etcd-history", "5s")
    try:
        yield cli
    finally:
        cli.run("down", check=False)


@pytest.mark.slow
@pytest.mark.timeout(480)  # about 70 s here; room for a loaded CI machine
def test_a_short_job_learns_and_accounts_for_every_trajectory(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    stack.run(
        "submit",
        str(EXAMPLE),
        "--id",
        "learn",
        f"model.path={model_dir}",
        f"trainer.steps={STEPS}",
        "trainer.eval_every=10",
        f"trainer.max_staleness={STALENESS}",
    )
    # Mid-job, `weights` shows the versions in etcd with their holders, and each rollout's
    # pulls as its heartbeats report them.
    plane: dict[str, Any] = {}

    def pulled_and_relayed() -> bool:
        got = stack.json("weights", "learn")
        assert isinstance(got, dict)
        plane.update(got)
        rollouts = [m for m in plane["members"] or [] if m["role"] == "rollout"]
        trainers = [m for m in plane["members"] or [] if m["role"] == "trainer"]
        relayed = any(h["role"] == "relay" for v in plane["versions"] for h in v["holders"])
        return (
            relayed
            and len(rollouts) == 2
            and all(m["counters"].get("weights_pulls", 0) >= 2 for m in rollouts)
            and len(trainers) == 1
            and trainers[0]["counters"].get("weights_bytes_served", 0) > 0
        )

    eventually_sync(pulled_and_relayed, timeout=120, interval=0.5)
    assert plane["announcement"]["transport"] == "ucx"
    newest = plane["versions"][0]
    assert newest["manifest"]["checksum_algorithm"] == "xxh3_128"
    assert newest["manifest"]["buckets"] >= 1 and newest["manifest"]["total_bytes"] > 0
    holders = [h for v in plane["versions"] for h in v["holders"]]
    assert {"instance_id": "trainer-0", "role": "trainer"} in [
        {"instance_id": h["instance_id"], "role": h["role"]} for h in holders
    ]
    assert all(h["same_bytes"] for h in holders)
    table = stack.run("weights", "learn").stdout
    assert "HOLDERS" in table and "PULLING" in table

    watch = stack.run("watch", "learn", check=False, timeout=420)
    assert watch.returncode == 0, watch.stdout + watch.stderr

    status = stack.json("status", "learn")
    assert isinstance(status, dict) and status["phase"] == "SUCCEEDED"
    assert status["step"] == STEPS and status["weight_version"] == STEPS
    # Goodput against a job read from the same stack (here the job itself: 1.00).
    against = stack.json("status", "learn", "--against", "learn")
    assert isinstance(against, dict) and against["goodput"]["goodput"] == 1.0
    unknown = stack.run("status", "learn", "--against", "nosuch", check=False)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr

    run = tmp_path / "runs" / "learn"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    assert len(evals) >= 3
    assert evals[-1] > evals[0] + 0.1, f"eval reward did not rise: {evals}"
    assert (run / "reward.png").stat().st_size > 0
    # Weights moved over UCX, the default: the trainer published on it, the rollouts pulled.
    logs = stack.home / "logs"
    assert "kind=ucx" in (logs / "trainer-0.log").read_text()
    for rollout in ("rollout-0", "rollout-1"):
        assert "weights.pulled" in (logs / f"{rollout}.log").read_text(), rollout

    # No trajectory id trained twice; every trained trajectory within the staleness bound.
    trained_ids: list[str] = []
    trained_groups: list[str] = []
    for line in (run / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for group, detail in entry["groups"].items():
            trained_groups.append(group)
            trained_ids += detail["ids"]
            for version in detail["versions"]:
                assert 0 <= entry["step"] - version <= STALENESS, (entry["step"], version)
    assert len(trained_ids) == len(set(trained_ids))
    assert len(trained_groups) == len(set(trained_groups)) == STEPS * 64

    # Every prompt group ever leased is trained or accounted for, with a reason. Leftovers
    # are settled on the coordinator's next round after the job ends: wait for that.
    def settled() -> bool:
        work = stack.json("status", "learn")["work"]
        return bool(work) and work["open"] == work["delivered"] == work["requeued"] == 0

    eventually_sync(settled, timeout=15)
    ledger = etcd_json(stack, "/robustrl/work/learn")
    leased = {f"learn-g{i:06d}" for i in range(int(str(ledger["next_index"])))}
    discarded = stack.json("dropped", "learn")  # the ledger and any pages, as a user reads it
    assert isinstance(discarded, dict) and all(discarded.values())
    assert ledger["trained"] == len(trained_groups) and ledger["dropped"] == len(discarded)
    assert leased == set(trained_groups) | discarded.keys()
    assert not set(trained_groups) & discarded.keys()
    # The same accounting, as a user reads it.
    work = stack.json("status", "learn")["work"]
    assert work["leased"] == len(leased) == work["trained"] + work["dropped"]
    assert work["open"] == work["delivered"] == work["requeued"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_job_input_fails_the_job_with_a_clear_message_and_no_crash(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text(
        "def raises(prompt, completion, answer):\n    raise ValueError('boom')\n\n"
        "def text(prompt, completion, answer):\n    return 'high'\n"
    )
    dataset = tmp_path / "rows.jsonl"
    rows = [{"id": f"row-{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)]
    rows.insert(2, {"id": "row-huge", "prompt": "+".join(["1"] * 400) + "=", "answer": "400"})
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cases = {
        "no-model": (["model.path=/nonexistent/model"], "model.path"),
        "no-plugin": ([f"model.path={model_dir}", "task.reward=nowhere:fn"], "task.reward"),
        "raises": ([f"model.path={model_dir}", f"task.reward={plugin}:raises"], "boom"),
        "not-a-number": (
            [f"model.path={model_dir}", f"task.reward={plugin}:text"],
            "expected a float",
        ),
        "too-long": ([f"model.path={model_dir}", "rollout.max_new_tokens=100000"], "context"),
        # One row of the dataset is longer than the model's context: the failure names it.
        "long-row": (
            [f"model.path={model_dir}", f"task.dataset={dataset}"],
            "dataset item 'row-huge'): prompt of",
        ),
    }
    for job, (overrides, text) in cases.items():
        stack.run("submit", str(EXAMPLE), "--id", job, "trainer.steps=3", *overrides)
        stack.run("watch", job, check=False)
        status = stack.json("status", job)
        assert isinstance(status, dict)
        assert status["phase"] == "FAILED", (job, status["phase"], status["message"])
        assert text in str(status["message"]), (job, status["message"])
    # Input the leader can judge alone is refused at submit: no job is recorded.
    refused = stack.run(
        "submit",
        str(EXAMPLE),
        "--id",
        "no-task",
        f"model.path={model_dir}",
        "task.name=chess",
        check=False,
    )
    assert refused.returncode != 0 and "unknown task 'chess'" in refused.stderr, refused
    assert "no-task" not in {job["job_id"] for job in stack.json("jobs")}
    # Every service survived all of that and is free for the next job.
    members = stack.members()
    assert sorted(str(m["instance_id"]) for m in members) == [
        "coordinator-0",
        "coordinator-1",
        "monitor-0",
        "rollout-0",
        "rollout-1",
        "trainer-0",
    ]
    # A failed job releases its members after it records FAILED: they come free, each.
    bound: list[tuple[str, str]] = []

    def all_free() -> bool:
        bound[:] = [
            (str(m["instance_id"]), str(m["job_id"])) for m in stack.members() if m["job_id"]
        ]
        return not bound

    eventually_sync(all_free, timeout=30, interval=0.2, unmet=lambda: f"still bound: {bound}")
