"""FSDP2 trainer ranks (`trainer.strategy: fsdp`) against real processes: each rank its own
member, a stopped rank named by a collective hang, a killed one failing its group, which is
restored on a new trainer from the checkpoint every rank wrote its part of. The rollouts go
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
    detection_stack,
    member,
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
    with detection_stack(tmp_path) as cli:
        yield cli


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
    )
    eventually_sync(lambda: step_of(stack, "fs") >= 4, timeout=180)
    # Each rank is a member of its own, with its rank and its job.
    ranks: dict[Any, Any] = {m["instance_id"]: m for m in stack.members() if m["role"] == "trainer"}
    assert (ranks["trainer-0"]["job_id"], ranks["trainer-0"]["rank"]) == ("fs", 0)
    rank1 = ranks["trainer-0-rank1"]
    assert (rank1["job_id"], rank1["rank"], rank1["labels"]["rank"]) == ("fs", 1, "1")

    # SIGSTOP of rank 1: rank 0 waits for it in the next collective, which names it.
    pid = int(rank1["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        hang = wait_for_incident(stack, "COLLECTIVE_HANG", "trainer-0-rank1", timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert hang["rank"] == 1 and "rank 1" in hang["evidence"], hang
    found: list[str] = []

    def replaced_once() -> bool:
        found.append(_replacement(stack, 1))
        return bool(found[-1])

    eventually_sync(replaced_once, timeout=60)
    replaced = found[-1]

    # kill -9 of the new group's rank 1: its member is lost, and the group with it.
    eventually_sync(lambda: step_of(stack, "fs") >= 12, timeout=180)
    killed = member(stack, f"{replaced}-rank1")
    assert (killed["job_id"], killed["rank"]) == ("fs", 1)
    os.kill(int(killed["pid"]), signal.SIGKILL)
    wait_for_incident(stack, "MEMBER_LOST", f"{replaced}-rank1", timeout=15)
    watch = stack.run("watch", "fs", check=False, timeout=360)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    status = stack.json("status", "fs")
    assert isinstance(status, dict) and status["phase"] == "SUCCEEDED", status
    first, second = status["recoveries"]
    assert first["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"], first
    assert second["actions"] == [f"FENCE {replaced}", f"RESTORE_TRAINER {replaced}"], second
    log = (tmp_path / "home" / "logs" / f"{second['replacements'][0]}.log").read_text()
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


def _replacement(cli: Cli, recoveries: int) -> str:
    """The trainer that took the job over in recovery number `recoveries`, once it is done."""
    status = cli.json("status", "fs")
    assert isinstance(status, dict)
    done = [r for r in status["recoveries"] if r["done_at"]]
    return str(done[recoveries - 1]["replacements"][0]) if len(done) >= recoveries else ""
