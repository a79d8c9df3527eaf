"""A job's run folder on this trainer: `metrics.jsonl` (the evaluation before training, then
each step's metrics), `trained.jsonl` (which trajectories, of which weight versions, each step
trained on) and `reward.png`. The logs keep only what the restored state contains, and a line
is written only while this trainer owns the job's checkpoint folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from robustrl.core.logs import get_logger
from services.trainer.checkpoint import replace_text
from services.trainer.intake import Group
from services.trainer.reward_plot import write_reward_plot

log = get_logger(__name__)


class Owner(Protocol):
    """Who says whether this trainer still owns the run (its checkpoint writer)."""

    def ensure_owner(self) -> None:
        """Raise (checkpoint.Superseded) once a newer trainer epoch has claimed the run."""


class RunLogs:
    def __init__(self, run_dir: Path, job_id: str) -> None:
        self.run_dir = run_dir
        self.job_id = job_id
        self.owner: Owner | None = None
        """Asked before every line; set once this trainer's checkpoint writer claimed the
        folder (None: no claim yet, as while the trainer loads)."""

    def set_aside_earlier_run(self) -> None:
        """A job's first trainer (FIRST_EPOCH) has nothing to restore: a run folder it finds
        is an earlier job's that had the same id (deleted, then submitted again). Restoring
        its checkpoint would put the new job at the old one's step, with nothing left to
        train (docs/decisions/0304). The folder is renamed, not removed: its checkpoints and
        logs are kept."""
        if not self.run_dir.exists() or not any(self.run_dir.iterdir()):
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.run_dir.with_name(f"{self.run_dir.name}.earlier-{stamp}")
        n = 0
        while aside.exists():
            n += 1
            aside = self.run_dir.with_name(f"{self.run_dir.name}.earlier-{stamp}-{n}")
        self.run_dir.rename(aside)
        log.warning("trainer.earlier_run_set_aside", job=self.job_id, moved_to=str(aside))

    def forget_after(self, step: int | None) -> None:
        """The run's logs keep only what the restored state contains: steps after the
        checkpoint were lost with the failed trainer and are trained again. None: nothing was
        restored, and the logs keep nothing."""
        # trained.jsonl numbers a step by the count before it (0 is the first step);
        # metrics.jsonl by the count after it (step 0 is the evaluation before training).
        last_kept = {"trained.jsonl": -1, "metrics.jsonl": -1}
        if step is not None:
            last_kept = {"trained.jsonl": step - 1, "metrics.jsonl": step}
        for name, last in last_kept.items():
            path = self.run_dir / name
            if not path.exists():
                continue
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line).get("step", 0) <= last
            ]
            # A new file in its place, not a truncation: a fenced trainer that opened the old
            # one before it was frozen writes into that one when it resumes (`append`).
            replace_text(path, "".join(line + "\n" for line in kept))

    def append(self, name: str, line: dict[str, Any]) -> None:
        """One line to a run log, while this trainer still owns the run: a replacement
        truncated the logs to the step it restored (`forget_after`), and a fenced trainer
        that had not heard of it yet would append a step the job never kept.

        The file is opened before the claim is read. A replacement claims the folder before
        it replaces the logs, so a trainer frozen anywhere in here (SIGSTOP) and resumed after
        its replacement either reads the claim or writes into the file the replacement has
        already replaced, which nothing reads again. Checked first and opened after, a
        trainer frozen in between would append its step to the replacement's log on
        resuming (docs/decisions/0011)."""
        with (self.run_dir / name).open("a") as out:
            if self.owner is not None:
                self.owner.ensure_owner()
            out.write(json.dumps(line) + "\n")

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """metrics.jsonl: one step's metrics (step 0: the evaluation before training)."""
        line = {"step": step, "version": step, "time": time.time(), **metrics}
        self.append("metrics.jsonl", line)

    def audit(self, step: int, batch: list[Group]) -> None:
        """trained.jsonl: which trajectories (and weight versions) each step trained on."""
        line = {
            "step": step,
            "groups": {
                g.group_id: {
                    "ids": sorted(g.trajectories),
                    "versions": [g.trajectories[t].weight_version for t in sorted(g.trajectories)],
                }
                for g in batch
            },
        }
        self.append("trained.jsonl", line)

    def plot(self) -> None:
        """reward.png from metrics.jsonl (matplotlib takes seconds: call it off the loop). A
        host without matplotlib writes none and says so: the plot is a view of metrics.jsonl,
        which the job's success does not wait on."""
        try:
            write_reward_plot(self.run_dir / "metrics.jsonl", self.run_dir / "reward.png")
        except ModuleNotFoundError as exc:
            log.warning("trainer.no_reward_plot", run=str(self.run_dir), reason=str(exc))
