"""benchmarks/ettr.py's attribution: the run's wall time cut along the trainer's kept steps,
so that the parts of its extra time over the fault-free run add up to that extra time."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def ettr(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("ettr")


def row(step: int, start: float, work: float, end: float) -> dict[str, float]:
    return {
        "step": step,
        "step_started_at": start,
        "step_work_started_at": work,
        "step_ended_at": end,
    }


def test_the_parts_add_up_to_the_extra_wall_time(ettr: ModuleType, tmp_path: Path) -> None:
    # Fault-free: submitted at 0, steps back to back from 2 to 8, the job ends at 9 (wall 9).
    reference = ettr.timeline(
        [row(1, 2, 2.5, 4), row(2, 4, 4.5, 6), row(3, 6, 6.5, 8)], 0.0, 9.0, [], 0.0
    )
    # Faulted: the trainer is lost after step 1 (killed at 5, detected at 5.4, the standby
    # bound at 6.0; a second incident at once overlaps it and is not counted twice), one
    # step rolled back (1.5 s of it), step 2 made again from 9; a longer wait for step 3; a
    # rollout lost while steps are made (12.6-13) is no gap; the job ends at 15 (wall 15).
    incidents = [
        {"failed_at": 5.0, "detected_at": 5.4, "recovered_at": 6.0},
        {"failed_at": None, "detected_at": 5.5, "recovered_at": 5.9},
        {"failed_at": 12.6, "detected_at": 12.7, "recovered_at": 13.0},
    ]
    run = ettr.timeline(
        [row(1, 2, 2.5, 4), row(2, 9, 9.5, 11), row(3, 11, 12.5, 14)], 0.0, 15.0, incidents, 1.5
    )
    parts = ettr.attribution(reference, run)
    assert sum(parts.values()) == pytest.approx(15.0 - 9.0)
    assert parts == pytest.approx(
        {
            "before": 0.0,
            "wait": 1.0,  # 2.0 s of waits against 1.5 s
            "work": 0.0,
            "gap_detection": 0.4,
            "gap_recovery": 0.6,
            "gap_rolled_back": 1.5,
            "gap_rest": 5.0 - 0.4 - 0.6 - 1.5,  # the 5 s between step 1 and step 2 made again
            "after": 0.0,
        }
    )
    assert sorted(key for _, key in ettr.ATTRIBUTION) == sorted(parts)

    # The kept steps come from metrics.jsonl, the last row of each step (a restore rewrites).
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 0, "eval_reward": 0.1}\n'
        '{"step": 1, "step_started_at": 1, "step_work_started_at": 1, "step_ended_at": 2}\n'
        '{"step": 2, "step_started_at": 2, "step_work_started_at": 2, "step_ended_at": 3}\n'
        '{"step": 2, "step_started_at": 5, "step_work_started_at": 5, "step_ended_at": 6}\n'
    )
    assert [r["step_started_at"] for r in ettr.step_rows(metrics)] == [1, 5]


def test_an_incident_takes_its_failure_time_from_the_last_injection_before_it(
    ettr: ModuleType,
) -> None:
    listed = '[\n  {"at": 4.0, "instance_id": "t"},\n  {"at": 9.0, "instance_id": "t"}\n]\n'
    out = "09:00:01 kill at step 3: trainer t (pid 1)\n" + listed
    injected = ettr.injections(out)
    assert [i["at"] for i in injected] == [4.0, 9.0]
    assert ettr.injections("nothing injected\n[]\n") == []
    # Commentary may follow the list (stderr is merged), or start with a bracket.
    assert ettr.injections("[12:00] note\n" + listed + "stopped by SIGTERM\n")[1]["at"] == 9.0
    with pytest.raises(ValueError, match="no injection list"):
        ettr.injections("Traceback: chaos failed\n")
    incidents = [
        {"instance_id": "t", "detected_at": 5.0},
        {"instance_id": "t", "detected_at": 9.5},
        {"instance_id": "r", "detected_at": 9.5},
    ]
    timed = ettr.with_failure_times(incidents, injected)
    assert [i["failed_at"] for i in timed] == [4.0, 9.0, None]
