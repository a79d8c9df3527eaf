"""`make demo`: a real GRPO job on the local stack, on CPU, with the leader coordinator
killed half way.

1. make the tiny model (once; `robustrl model init`);
2. bring the stack up: etcd, monitor, 2 coordinators, 1 trainer, 2 rollouts;
3. submit examples/arithmetic-grpo.yaml and follow it with a live progress line;
4. at a third of the steps, SIGKILL the leader coordinator: a standby takes over while the
   trainer and rollouts keep working;
5. print the eval curve, the incidents, where the metrics and the plot are; stop the stack.

Every step is a `robustrl` command, printed before it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

console = Console(soft_wrap=True)
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/arithmetic-grpo.yaml"
RUNS = Path(".robustrl/runs")


def robustrl(*args: str, capture: bool = False, echo: bool = True, check: bool = True) -> str:
    if echo:
        console.print(f"[bold cyan]$ robustrl {' '.join(args)}[/bold cyan]")
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=REPO,
        text=True,
        capture_output=capture,
        check=False,
    )
    if check and result.returncode != 0:
        if capture:
            console.print(result.stderr)
        raise SystemExit(f"demo: `robustrl {' '.join(args)}` failed (exit {result.returncode})")
    return result.stdout if capture else ""


def job_status(job_id: str) -> dict[str, object]:
    status: dict[str, object] = json.loads(
        robustrl("status", job_id, "--json", capture=True, echo=False)
    )
    return status


def leader_pid() -> int | None:
    members = json.loads(robustrl("members", "--json", capture=True, echo=False))
    return next((int(m["pid"]) for m in members if m["leader"]), None)


def kill_leader_when(job_id: str, step: int, watcher: subprocess.Popen[bytes]) -> None:
    while watcher.poll() is None:
        current = job_status(job_id)
        if int(str(current["step"])) >= step:
            pid = leader_pid()
            if pid is None:
                return
            console.print(f"\n[yellow]chaos: SIGKILL the leader coordinator (pid {pid})[/yellow]")
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.5)


def summary(job_id: str, took: float) -> None:
    metrics_path = REPO / RUNS / job_id / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    console.print("\n[bold]eval reward (greedy, held-out set) by step[/bold]")
    for step, reward in evals:
        console.print(f"  step {step:>3}  {reward:.3f}  {'#' * round(reward * 40)}")
    if len(evals) >= 2:
        gain = evals[-1][1] - evals[0][1]
        console.print(f"  first -> last: {evals[0][1]:.3f} -> {evals[-1][1]:.3f} ({gain:+.3f})")
    console.print(f"wall time for the job: {took:.0f}s")
    console.print(f"metrics: {RUNS / job_id / 'metrics.jsonl'}")
    console.print(f"reward curve: {RUNS / job_id / 'reward.png'}")


def main() -> int:
    robustrl("model", "init")
    robustrl("down")  # whatever an earlier run left behind
    robustrl("up", "--trainers", "1", "--rollouts", "2")
    job_id = f"demo-{int(time.time())}"
    try:
        robustrl("submit", EXAMPLE, "--id", job_id)
        spec_steps = int(json.loads(json.dumps(job_status(job_id)["spec"]))["trainer"]["steps"])
        console.print(f"[bold cyan]$ robustrl watch {job_id}[/bold cyan]")
        started = time.monotonic()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "watch", job_id], cwd=REPO
        )
        kill_leader_when(job_id, max(1, spec_steps // 3), watcher)
        rc = watcher.wait()
        took = time.monotonic() - started
        robustrl("incidents")
        robustrl("members")
        if rc != 0:
            robustrl("status", job_id)
            return rc
        summary(job_id, took)
    finally:
        robustrl("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
