"""`make demo`: a real GRPO job on the local stack, on CPU, with failures injected on a
seeded schedule and recovered role by role.

1. make the tiny model (once; `robustrl model init`);
2. bring the stack up: etcd, monitor, 2 coordinators, 1 trainer and 1 warm standby trainer, 2
   rollouts and 1 warm standby rollout;
3. submit examples/arithmetic-grpo.yaml and follow it with a live progress line;
4. inject, at steps drawn from the seed (`robustrl chaos`, and a SIGKILL for the leader):
   - a rollout hang (SIGSTOP; the standby rollout, which kept the job's engine and weights,
     replaces it; it comes back as a zombie after its replacement, and is fenced);
     with `--engine vllm` only the rollout's vLLM engine core is stopped, and the rollout
     service, still beating, is found hung by its progress;
   - the leader coordinator killed: a standby takes over, no data-plane role restarts;
   - the trainer killed: a new trainer restores the last checkpoint, rollouts keep going;
   - the trainer (now the former standby) stopped by an error at one step, as a failing device
     would: replaced the same way, the job goes on;
5. once the faults are done and while the job still runs, show its weight plane
   (`robustrl weights`: versions, holders and relays, each member's pulls);
6. print the eval curve, ETTR, each incident's recovery time, where the metrics and the plot
   are; stop the stack.

Every step is a `robustrl` command, printed before it runs. `--engine vllm` (`make demo
ENGINE=vllm`) runs the rollouts on vLLM instead of the torch engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
        [sys.executable, "-m", "robustrl.cli.main", *args],
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


SEED = 7


def schedule(steps: int, seed: int = SEED) -> list[tuple[int, str]]:
    """(step, fault) in step order: one of each kind, at steps drawn from the seed."""
    rng = random.Random(seed)
    return [
        (rng.randint(int(0.15 * steps), int(0.25 * steps)), "rollout-hang"),
        (rng.randint(int(0.35 * steps), int(0.45 * steps)), "leader-kill"),
        (rng.randint(int(0.55 * steps), int(0.65 * steps)), "trainer-kill"),
        (rng.randint(int(0.75 * steps), int(0.85 * steps)), "trainer-error"),
    ]


def inject(job_id: str, fault: str) -> None:
    if fault == "trainer-kill":
        robustrl("chaos", job_id, "--role", "trainer", "--fault", "kill", "--seed", str(SEED))
    elif fault == "trainer-error":
        robustrl("chaos", job_id, "--role", "trainer", "--fault", "error", "--seed", str(SEED))
    elif fault == "leader-kill":
        pid = leader_pid()
        if pid is not None:
            console.print(f"[yellow]chaos: SIGKILL the leader coordinator (pid {pid})[/yellow]")
            os.kill(pid, signal.SIGKILL)


def run_schedule(
    job_id: str, plan: list[tuple[int, str]], watcher: subprocess.Popen[bytes], engine: str
) -> None:
    hangs: list[subprocess.Popen[bytes]] = []
    for step, fault in plan:
        while watcher.poll() is None and int(str(job_status(job_id)["step"])) < step:
            time.sleep(0.5)
        if watcher.poll() is not None:
            break
        console.print(f"\n[yellow]chaos at step {step}: {fault}[/yellow]")
        if fault == "rollout-hang":
            # Comes back 20 s later, after its replacement: a zombie that must change nothing.
            # `--hang-for` keeps the command running until it has resumed the process.
            # On vLLM, only the engine core stops: the service keeps beating.
            args = ["chaos", job_id, "--role", "rollout", "--fault", "hang", "--hang-for", "20"]
            args += ["--seed", str(SEED), *(["--engine"] if engine == "vllm" else [])]
            console.print(f"[bold cyan]$ robustrl {' '.join(args)}[/bold cyan]")
            hangs.append(
                subprocess.Popen([sys.executable, "-m", "robustrl.cli.main", *args], cwd=REPO)
            )
        else:
            inject(job_id, fault)
    for hang in hangs:
        hang.wait()


def recovered(job_id: str, watcher: subprocess.Popen[bytes], steps: int = 5) -> bool:
    """Whether the job, still running, has recovered from the last fault and trained `steps`
    steps since (False once it has ended)."""
    start: int | None = None
    while watcher.poll() is None:
        status = job_status(job_id)
        step = int(str(status["step"]))
        if status["phase"] == "RUNNING":
            start = step if start is None else start
            if step >= start + steps:
                return True
        time.sleep(0.5)
    return False


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
    robustrl("status", job_id)
    console.print(f"metrics: {RUNS / job_id / 'metrics.jsonl'}")
    console.print(f"reward curve: {RUNS / job_id / 'reward.png'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m robustrl.cli.demo")
    parser.add_argument(
        "--engine", choices=["torch", "vllm"], default="torch", help="the rollouts' engine"
    )
    engine = parser.parse_args(argv).engine
    robustrl("model", "init")
    robustrl("down")  # whatever an earlier run left behind
    robustrl(
        "up",
        "--trainers",
        "1",
        "--standby-trainers",
        "1",
        "--rollouts",
        "2",
        "--standby-rollouts",
        "1",
    )
    job_id = f"demo-{int(time.time())}"
    try:
        robustrl("submit", EXAMPLE, "--id", job_id, f"rollout.engine={engine}")
        spec_steps = int(json.loads(json.dumps(job_status(job_id)["spec"]))["trainer"]["steps"])
        console.print(f"[bold cyan]$ robustrl watch {job_id}[/bold cyan]")
        started = time.monotonic()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "robustrl.cli.main", "watch", job_id], cwd=REPO
        )
        plan = schedule(spec_steps)
        faults = ", ".join(f"{fault} at step {step}" for step, fault in plan)
        console.print(f"chaos schedule (seed {SEED}): {faults}")
        run_schedule(job_id, plan, watcher, engine)
        if recovered(job_id, watcher):
            # The weight plane after the faults, while the job still runs: the versions with
            # their holders (trainer and relays), each member's pulls, the replacements' too.
            robustrl("weights", job_id, check=False)
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
