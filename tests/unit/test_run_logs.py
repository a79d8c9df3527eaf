"""The run folder's reward plot: drawn from metrics.jsonl, and left out (never failing the job)
where the trainer's host has no matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from services.trainer.run_logs import RunLogs


def test_the_reward_plot_is_drawn_or_left_out_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5, "eval_reward": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = RunLogs(tmp_path, "j")
    logs.plot()
    assert (tmp_path / "reward.png").stat().st_size > 0
    (tmp_path / "reward.png").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    logs.plot()
    assert not (tmp_path / "reward.png").exists()
