"""`robustrl status JOB --against REF`: the job's goodput against the same job run without
faults, and a clear refusal where the two cannot be compared."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from robustrl.cli.context import UsageError
from robustrl.cli.job_commands import goodput


def job(job_id: str, phase: str, step: int, wall: float | None, steps: int = 300) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "phase": phase,
        "step": step,
        "spec": {"trainer": {"steps": steps}},
        "ettr": None if wall is None else {"wall_s": wall},
    }


def test_goodput_is_the_fault_free_wall_time_over_the_jobs() -> None:
    reference = job("ref", "SUCCEEDED", 300, 44.0)
    ended = goodput(job("faulted", "SUCCEEDED", 300, 58.0), reference)
    assert ended == {
        "against": "ref",
        "goodput": pytest.approx(44.0 / 58.0),
        "reference_wall_s": 44.0,
        "wall_s": 58.0,
        "so_far": False,
    }
    # While it runs: the reference's time for the steps made so far, pro rata.
    running = goodput(job("faulted", "RUNNING", 150, 30.0), reference)
    assert running["so_far"] and running["goodput"] == pytest.approx(22.0 / 30.0)


@pytest.mark.parametrize(
    ("this", "reference", "message"),
    [
        (job("j", "RUNNING", 5, 9.0), job("r", "RUNNING", 9, 9.0), "that job is RUNNING"),
        (job("j", "RUNNING", 5, 9.0), job("r", "SUCCEEDED", 9, 9.0, steps=9), "not the same job"),
        (job("j", "PENDING", 0, None), job("r", "SUCCEEDED", 300, 44.0), "j has no time account"),
    ],
)
def test_jobs_that_cannot_be_compared_are_refused_with_why(
    this: dict[str, Any], reference: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        goodput(this, reference)


def test_against_without_a_job_is_a_usage_error_before_the_stack_is_asked() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "robustrl.cli.main", "status", "--against", "ref"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--against compares one job with another: name the job" in out.stderr
