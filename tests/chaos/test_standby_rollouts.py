"""Warm standby rollouts against real processes: a standby prepared for a running job keeps
its engine and the job's weights, takes over a lost rollout at once, and is refilled; a
standby lost or hung while prepared is fenced from the job, never bound, and replaced. In
each, nothing is lost or trained twice."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.test_recovery import ROLLOUT_1_REPLACED, finish, pids, recoveries, submit
from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, etcd_json
from tests.support.detection import detection_stack, incidents, wait_for_incident

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 300
"""Outlasts the standbys' preparation, a standby's loss and a rollout's."""


def prepared_for(cli: Cli, job: str) -> list[str]:
    """The free standby rollouts prepared for `job`, by name."""
    found = []
    for m in cli.members():
        labels = m["labels"]
        assert isinstance(labels, dict)
        standby = m["role"] == "rollout" and labels.get("standby") == "true"
        if standby and not m["job_id"] and labels.get("prepared") == job:
            found.append(str(m["instance_id"]))
    return sorted(found)


def fence_of(cli: Cli, instance_id: str) -> dict[str, Any]:
    return etcd_json(cli, f"/robustrl/fences/{instance_id}")


def took_over_with_pulled_weights(log: str) -> bool:
    """Prepared, pulled weights while it stood by, then was bound and generated."""
    prepared = log.index("rollout.prepared")
    pulled = log.index("rollout.weights_loaded", prepared)
    took = log.index("rollout.took_prepared", pulled)
    return log.index("rollout.first_batch", took) > took


def test_a_standby_rollout_takes_over_a_killed_rollout_and_a_killed_standby_is_replaced(
    tmp_path: Path, model_dir: Path
) -> None:
    with detection_stack(tmp_path, "--standby-rollouts", "2") as cli:
        submit(cli, model_dir, "sr", f"trainer.steps={STEPS}")
        eventually_sync(
            lambda: prepared_for(cli, "sr") == ["standby-rollout-0", "standby-rollout-1"],
            timeout=120,
        )
        before = pids(cli, "trainer-0", "rollout-0", "standby-rollout-1", "rollout-1")
        # A standby lost while prepared is fenced from the job (and replaced, below).
        os.kill(before.pop("standby-rollout-1"), signal.SIGKILL)
        wait_for_incident(cli, "MEMBER_LOST", "standby-rollout-1", timeout=15)
        eventually_sync(lambda: bool(fence_of(cli, "standby-rollout-1")), timeout=15)
        assert fence_of(cli, "standby-rollout-1")["job_id"] == "sr"
        # A rollout of the job is killed: the prepared standby takes its place at once.
        os.kill(before.pop("rollout-1"), signal.SIGKILL)
        wait_for_incident(cli, "MEMBER_LOST", "rollout-1", timeout=15)
        finish(cli, "sr")
        [rec] = recoveries(cli, "sr")
        assert rec["actions"] == ROLLOUT_1_REPLACED
        [standby] = rec["replacements"]
        assert standby.startswith("standby-rollout"), rec
        log = (tmp_path / "home" / "logs" / f"{standby}.log").read_text()
        assert took_over_with_pulled_weights(log), log[-3000:]
        assert pids(cli, "trainer-0", "rollout-0") == before  # nothing else was replaced
        # Both the lost standby and the bound one were refilled.
        eventually_sync(lambda: len(refills(cli)) == 2, timeout=120)
        assert_nothing_lost_or_trained_twice(cli, "sr", tmp_path / "runs" / "sr", STEPS)


def refills(cli: Cli) -> list[str]:
    names = [str(m["instance_id"]) for m in cli.members()]
    return [n for n in names if n.startswith("standby-rollout-p")]


def any_incident(cli: Cli, instance_id: str) -> bool:
    return any(i["instance_id"] == instance_id for i in incidents(cli))


def test_a_hung_standby_rollout_is_fenced_and_never_bound(tmp_path: Path, model_dir: Path) -> None:
    with detection_stack(tmp_path, "--standby-rollouts", "1") as cli:
        submit(cli, model_dir, "sh", f"trainer.steps={STEPS}")
        eventually_sync(lambda: prepared_for(cli, "sh") == ["standby-rollout-0"], timeout=120)
        hung, rollout = pids(cli, "standby-rollout-0", "rollout-1").values()
        os.kill(hung, signal.SIGSTOP)
        try:
            eventually_sync(lambda: any_incident(cli, "standby-rollout-0"), timeout=30)
            eventually_sync(lambda: bool(fence_of(cli, "standby-rollout-0")), timeout=15)
            assert fence_of(cli, "standby-rollout-0")["job_id"] == "sh"
            os.kill(rollout, signal.SIGKILL)  # a rollout of the job is lost meanwhile
            wait_for_incident(cli, "MEMBER_LOST", "rollout-1", timeout=15)
        finally:
            os.kill(hung, signal.SIGCONT)  # it comes back, free, and looks bindable
        finish(cli, "sh")
        [rec] = recoveries(cli, "sh")
        assert rec["replacements"] and rec["replacements"] != ["standby-rollout-0"], rec
        log = (tmp_path / "home" / "logs" / "standby-rollout-0.log").read_text()
        assert "rollout.took_prepared" not in log
        assert_nothing_lost_or_trained_twice(cli, "sh", tmp_path / "runs" / "sh", STEPS)
