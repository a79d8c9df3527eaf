"""The run's reward curve, drawn from metrics.jsonl (train reward per step, eval reward)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_reward_plot(metrics_path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    evals = [(r["step"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train reward (sampled)", alpha=0.6)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval reward (greedy, held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
