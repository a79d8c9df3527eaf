"""A local stack in its own ROBUSTRL_HOME, driven through the `robustrl` CLI: what the
benchmarks that start one (detection.py, ettr.py) share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "arithmetic-grpo.yaml"


class Stack:
    def __init__(self, home: Path, runs: Path, env: dict[str, str] | None = None) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROBUSTRL_")}
        self.env |= {"ROBUSTRL_HOME": str(home), "ROBUSTRL_TRAINER_RUNS_DIR": str(runs)}
        self.env |= env or {}
        self.runs = runs

    @staticmethod
    def argv(*args: str) -> list[str]:
        return [sys.executable, "-m", "robustrl.cli.main", *args]

    def cli(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"robustrl {' '.join(args)}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def background(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=REPO,
        )

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json"))

    def pid(self, instance_id: str) -> int:
        return int(next(m["pid"] for m in self.json("members") if m["instance_id"] == instance_id))

    def step(self, job: str) -> int:
        return int(self.json("status", job)["step"])

    def incidents(self, job: str = "") -> list[dict[str, Any]]:
        return list(self.json("incidents", *([job] if job else [])))


def ensure_model(model: Path) -> None:
    """Make the tiny model with `robustrl model init` unless `model` already holds one."""
    if not (model / "config.json").exists():
        subprocess.run(Stack.argv("model", "init", "--out", str(model)), cwd=REPO, check=True)
