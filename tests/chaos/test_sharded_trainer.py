"""FSDP2 trainer ranks (`trainer.strategy: fsdp`) against real processes: each rank a trainer
member started on its own and bound by the leader, a stopped rank named by a collective hang,
a killed one failing its group, which is restored on a new group (trainers the provisioner
starts) from the checkpoint every rank wrote its part of. The rollouts go
on throughout; the job succeeds; nothing is lost or trained twice."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.trainer import checkpoint
from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli
from tests.support.detection import (
    RANKS_SILENCE,
    detection_stack,
    step_of,
    submit,
    wait_for_incident,
)

STEPS = 60
"""Long enough to outlast two recoveries (about 8 s each here, longer on a loaded machine: a
new trainer process and its rank start, then restore) at about 3 steps a second; each step
past that adds time."""

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Cli]:
    env = {"ROBUSTRL_MONITOR_SILENCE_WINDOW": str(RANKS_SILENCE)}
    with detection_stack(tmp_path, "--trainers", "2", env=env) as cli:
        yield cli


def _ranks(cli: Cli, job: str) -> dict[int, dict[str, Any]]:
    """The job's trainer members by rank."""
    members: list[dict[str, Any]] = cli.members()
    return {m["rank"]: m for m in members if m["role"] == "trainer" and m["job_id"] == job}


def test_fsdp_ranks_are_members_a_stopped_one_is_named_and_a_killed_one_is_recovered(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    rollouts = {m["instance_id"]: m["pid"] for m in stack.members() if m["role"] == "rollout"}
    submit(
        stack,
        model_dir,
        "fs",
        f"trainer.steps={STEPS}",
        "trainer.strategy=fsdp",
        "trainer.world_size=2",
        # The model's 1.1 MiB in one bucket, which rank 0 serves: the rollouts never pull from
        # rank 1. Stopped while holding a bucket of the newest version, it would stall every
        # rollout's pull (up to the UCX stall timeout), no batch would reach rank 0, and rank 0
        # would never enter the collective that names the stopped rank. A bucket on each rank
        # is test_stack_across_hosts' case.
    )
    eventually_sync(lambda: step_of(stack, "fs") >= 4, timeout=180)
    # Each rank is a trainer member of its own, started on its own by `up` (neither is the
    # other's child), bound by the leader with its rank.
    ranks = _ranks(stack, "fs")
    assert sorted(ranks) == [0, 1], ranks
    assert {ranks[0]["instance_id"], ranks[1]["instance_id"]} == {"trainer-0", "trainer-1"}
    assert ranks[1]["labels"]["rank"] == "1" and ranks[1]["labels"]["follower"] == "true"
    assert _parent(int(ranks[1]["pid"])) != int(ranks[0]["pid"])
    assert _parent(int(ranks[0]["pid"])) != int(ranks[1]["pid"])
    first_group = {r["instance_id"] for r in ranks.values()}

    # SIGSTOP of rank 1: rank 0 waits for it in the next collective, which names it.
    stopped = ranks[1]["instance_id"]
    pid = int(ranks[1]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        hang = wait_for_incident(stack, "COLLECTIVE_HANG", stopped, timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert hang["rank"] == 1 and "rank 1" in hang["evidence"], hang
    eventually_sync(lambda: _recovered(stack, 1), timeout=120)

    # kill -9 of the new group's rank 1: its member is lost, and the group with it.
    eventually_sync(lambda: step_of(stack, "fs") >= 12, timeout=180)
    second = _ranks(stack, "fs")
    assert sorted(second) == [0, 1] and not first_group & {
        r["instance_id"] for r in second.values()
    }
    killed = second[1]["instance_id"]
    os.kill(int(second[1]["pid"]), signal.SIGKILL)
    wait_for_incident(stack, "MEMBER_LOST", killed, timeout=30)
    watch = stack.run("watch", "fs", check=False, timeout=360)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    status = stack.json("status", "fs")
    assert isinstance(status, dict) and status["phase"] == "SUCCEEDED", status
    first, again = status["recoveries"]
    assert first["actions"] == [
        *(f"FENCE {i}" for i in sorted(first_group)),
        f"RESTORE_TRAINER {stopped}",
    ], first
    assert again["actions"] == [
        *(
            f"FENCE {second[r]['instance_id']}"
            for r in sorted(second, key=lambda r: second[r]["instance_id"])
        ),
        f"RESTORE_TRAINER {killed}",
    ], again
    log = (tmp_path / "home" / "logs" / f"{again['replacements'][0]}.log").read_text()
    assert "trainer.restored" in log and "trainer.ranks_started" in log

    run = tmp_path / "runs" / "fs"
    latest = checkpoint.load_latest(run / "checkpoints")
    assert latest is not None and latest.sharded and latest.step == STEPS
    assert sorted(p.name for p in latest.path.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # Only the trainer group was replaced: the same rollout processes served the whole job.
    assert {
        m["instance_id"]: m["pid"] for m in stack.members() if m["role"] == "rollout"
    } == rollouts
    assert_nothing_lost_or_trained_twice(stack, "fs", run, steps_run=STEPS)


def _recovered(cli: Cli, recoveries: int) -> bool:
    """Whether recovery number `recoveries` is done (its whole new group bound)."""
    status = cli.json("status", "fs")
    assert isinstance(status, dict)
    return len([r for r in status["recoveries"] if r["done_at"]]) >= recoveries


def _parent(pid: int) -> int:
    """The parent pid of `pid`, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
