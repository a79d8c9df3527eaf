"""Warm standby rollouts against real processes: a standby prepared for a running job keeps
its engine and the job's weights, takes over a lost rollout at once, and is refilled; a
standby lost or hung while prepared is fenced from the job, never bound, and replaced;
nothing is lost or trained twice."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, etcd_json
from tests.support.detection import detection_stack, incidents, wait_for_incident
from tests.support.recovery import (
    ROLLOUT_1_REPLACED,
    end_after,
    finish,
    pids,
    recovered,
    recoveries,
    submit,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 300
"""A ceiling: outlasts the standbys' preparation, a standby's loss and a rollout's on a loaded
machine; once the standby has taken over and generates, the job is ended a few steps later."""


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
    """The fence record of the instance; {} while there is none."""
    try:
        return etcd_json(cli, f"/robustrl/fences/{instance_id}")
    except ValueError:  # no such key: etcdctl prints nothing
        return {}


def took_over_with_pulled_weights(log: str) -> bool:
    """Prepared, pulled weights while it stood by, then was bound and generated."""
    prepared = log.index("rollout.prepared")
    pulled = log.index("rollout.weights_loaded", prepared)
    took = log.index("rollout.took_prepared", pulled)
    return log.index("rollout.first_batch", took) > took


def took_over_and_generated(log: Path) -> bool:
    """took_over_with_pulled_weights, false while a line it looks for is not logged yet."""
    try:
        return took_over_with_pulled_weights(log.read_text())
    except ValueError:  # str.index: not there (yet)
        return False


def refills(cli: Cli) -> list[str]:
    names = [str(m["instance_id"]) for m in cli.members()]
    return [n for n in names if n.startswith("standby-rollout-p")]


def any_incident(cli: Cli, instance_id: str) -> bool:
    return any(i["instance_id"] == instance_id for i in incidents(cli))


def test_a_standby_rollout_takes_over_and_lost_or_hung_standbys_are_fenced_and_replaced(
    tmp_path: Path, model_dir: Path
) -> None:
    """Three standbys prepared for the job: one is killed, one hung (SIGSTOP), then a rollout
    of the job is killed. The killed and the hung standby are fenced from the job and
    replaced; the third, which kept pulling the job's weights, takes the lost rollout's
    place; the hung one, resumed, is never bound. (One job for all of it: each stack and job
    costs the suite about 40 s.)"""
    with detection_stack(tmp_path, "--standby-rollouts", "3") as cli:
        submit(cli, model_dir, "sr", f"trainer.steps={STEPS}")
        standbys = [f"standby-rollout-{i}" for i in range(3)]
        eventually_sync(lambda: prepared_for(cli, "sr") == standbys, timeout=120)
        before = pids(cli, "trainer-0", "rollout-0", "rollout-1", *standbys[1:])
        killed, hung = before.pop("standby-rollout-1"), before.pop("standby-rollout-2")
        os.kill(killed, signal.SIGKILL)
        os.kill(hung, signal.SIGSTOP)
        try:
            wait_for_incident(cli, "MEMBER_LOST", "standby-rollout-1", timeout=15)
            eventually_sync(lambda: any_incident(cli, "standby-rollout-2"), timeout=30)
            fenced = standbys[1:]
            eventually_sync(lambda: all(fence_of(cli, n) for n in fenced), timeout=15)
            assert [fence_of(cli, n)["job_id"] for n in fenced] == ["sr", "sr"]
            # A rollout of the job is killed: the prepared standby takes its place at once.
            os.kill(before.pop("rollout-1"), signal.SIGKILL)
            wait_for_incident(cli, "MEMBER_LOST", "rollout-1", timeout=15)
        finally:
            os.kill(hung, signal.SIGCONT)  # it comes back, free, and looks bindable
        # The takeover is done and seen generating before the job is ended soon after it.
        eventually_sync(lambda: recovered(cli, "sr"), timeout=120)
        [taken] = recoveries(cli, "sr")
        assert taken["actions"] == ROLLOUT_1_REPLACED
        [standby] = taken["replacements"]
        assert standby.startswith("standby-rollout") and standby != "standby-rollout-2", taken
        standby_log = tmp_path / "home" / "logs" / f"{standby}.log"
        eventually_sync(
            lambda: took_over_and_generated(standby_log),
            timeout=60,
            unmet=lambda: standby_log.read_text()[-3000:],
        )
        steps = end_after(cli, "sr", lambda: True)
        finish(cli, "sr")
        [rec] = recoveries(cli, "sr")
        assert rec["actions"] == ROLLOUT_1_REPLACED
        [standby] = rec["replacements"]
        assert standby.startswith("standby-rollout") and standby != "standby-rollout-2", rec
        log = (tmp_path / "home" / "logs" / f"{standby}.log").read_text()
        assert took_over_with_pulled_weights(log), log[-3000:]
        hung_log = (tmp_path / "home" / "logs" / "standby-rollout-2.log").read_text()
        assert "rollout.took_prepared" not in hung_log
        assert pids(cli, "trainer-0", "rollout-0") == before  # nothing else was replaced
        # The killed standby, the hung one and the one bound were each refilled.
        eventually_sync(lambda: len(refills(cli)) == 3, timeout=120)
        assert_nothing_lost_or_trained_twice(cli, "sr", tmp_path / "runs" / "sr", steps)
