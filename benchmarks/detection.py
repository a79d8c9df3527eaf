"""Detection latency per failure kind, and false positives over a fault-free run.

Each scenario runs on a fresh local stack (real etcd, coordinators, monitor, trainer and
rollout processes, started with `robustrl up`) and injects one failure into a running job:

  crash_rollout / crash_trainer  kill -9 of the member           bound: session TTL + 1 s
  rollout_hang                   SIGSTOP of a generating rollout bound: silence window + probe
  nan_loss                       NaN in the loss at step S       bound: the end of step S
  collective_hang                SIGSTOP of trainer rank 1 of 2  bound: collective budget + 1 s

and the fault-free run (long-tail generations, a checkpoint every step, rollouts idle while
they wait for each version) counts every incident as a false positive.

    python benchmarks/detection.py                 # all scenarios
    python benchmarks/detection.py --only nan_loss --calm-steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from local_stack import EXAMPLE, REPO, Stack, ensure_model

TTL = 8.0
SILENCE = 2.0
PROBE_WAIT = 1.0
PROBE_DEADLINE = 2.0
COLLECTIVE_BUDGET = 2.0
DETECTION_ENV = {
    "ROBUSTRL_ETCD_SESSION_TTL": str(int(TTL)),
    "ROBUSTRL_MONITOR_SILENCE_WINDOW": str(SILENCE),
    "ROBUSTRL_MONITOR_PROBE_WAIT": str(PROBE_WAIT),
    "ROBUSTRL_MONITOR_PROBE_DEADLINE": str(PROBE_DEADLINE),
    "ROBUSTRL_MONITOR_COLLECTIVE_BUDGET": str(COLLECTIVE_BUDGET),
}


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)


@dataclass
class Result:
    kind: str
    incident: str
    latency: float | None
    bound: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.latency is not None and self.latency <= self.bound


def first_incident(stack: Stack, kind: str, instance_id: str, timeout: float) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [
            i for i in stack.incidents() if i["kind"] == kind and i["instance_id"] == instance_id
        ]
        return bool(found)

    wait(seen, timeout, f"{kind} on {instance_id}")
    return found[0]


def submit(stack: Stack, model: Path, job: str, *overrides: str) -> None:
    stack.cli(
        "submit",
        str(EXAMPLE),
        "--id",
        job,
        f"model.path={model}",
        "trainer.groups_per_step=8",
        "trainer.eval_every=1000",
        *overrides,
    )


def crash(stack: Stack, model: Path, victim: str) -> Result:
    submit(stack, model, "crash", "trainer.steps=500")
    wait(lambda: stack.step("crash") >= 2, 180, "job running")
    os.kill(stack.pid(victim), signal.SIGKILL)
    at = time.time()
    incident = first_incident(stack, "MEMBER_LOST", victim, TTL + 10)
    return Result(f"crash {victim}", "MEMBER_LOST", incident["detected_at"] - at, TTL + 1.0)


def rollout_hang(stack: Stack, model: Path) -> Result:
    submit(stack, model, "hang", "trainer.steps=500", "rollout.max_new_tokens=32")
    wait(lambda: stack.step("hang") >= 1, 180, "job running")
    pid = stack.pid("rollout-0")
    os.kill(pid, signal.SIGSTOP)
    at = time.time()
    try:
        incident = first_incident(stack, "ROLLOUT_HANG", "rollout-0", TTL + 10)
    finally:
        os.kill(pid, signal.SIGCONT)
    bound = SILENCE + PROBE_WAIT + PROBE_DEADLINE + 1.0
    return Result("rollout hang (SIGSTOP)", "ROLLOUT_HANG", incident["detected_at"] - at, bound)


def nan_loss(stack: Stack, model: Path, at_step: int = 4) -> Result:
    submit(stack, model, "nan", "trainer.steps=8", f"faults.nan_loss_steps=[{at_step}]")
    incident = first_incident(stack, "NON_FINITE", "trainer-0", 300)
    stack.cli("watch", "nan", timeout=300)
    rows = [
        json.loads(x) for x in (stack.runs / "nan" / "metrics.jsonl").read_text().split("\n") if x
    ]
    times = {r["step"]: r["time"] for r in rows}
    started = times[at_step - 1]  # step S starts when step S-1 was recorded
    budget = times[at_step] - started  # and ends when step S is recorded
    return Result(
        f"NaN loss at step {at_step}",
        "NON_FINITE",
        incident["detected_at"] - started,
        budget,
        "bound: the end of step S",
    )


def collective_hang(stack: Stack, model: Path) -> Result:
    submit(stack, model, "ranks", "trainer.steps=500", "trainer.world_size=2")
    wait(lambda: stack.step("ranks") >= 2, 240, "job running on two ranks")
    rank1 = next(
        m
        for m in stack.json("members")
        if m["role"] == "trainer" and m["job_id"] == "ranks" and m["rank"] == 1
    )
    pid = int(rank1["pid"])
    os.kill(pid, signal.SIGSTOP)
    at = time.time()
    try:
        incident = first_incident(stack, "COLLECTIVE_HANG", rank1["instance_id"], TTL + 20)
    finally:
        os.kill(pid, signal.SIGCONT)
    note = f"named rank {incident['rank']}"
    # The budget counts from when rank 0 entered the collective, at most one step after the stop.
    return Result(
        "collective hang (rank 1 stopped)",
        "COLLECTIVE_HANG",
        incident["detected_at"] - at,
        COLLECTIVE_BUDGET + 1.0,
        note,
    )


def calm(stack: Stack, model: Path, steps: int) -> tuple[int, float]:
    submit(
        stack,
        model,
        "calm",
        f"trainer.steps={steps}",
        "trainer.max_staleness=0",
        "trainer.checkpoint_every=1",
        "rollout.long_tail_every=5",
        "rollout.long_tail_factor=20",
    )
    started = time.monotonic()
    stack.cli("watch", "calm", timeout=3600)
    return len(stack.incidents()), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / ".robustrl" / "models" / "tiny-qwen"))
    parser.add_argument("--calm-steps", type=int, default=40)
    parser.add_argument(
        "--only",
        choices=[
            "calm",
            "crash_rollout",
            "crash_trainer",
            "rollout_hang",
            "nan_loss",
            "collective",
        ],
        action="append",
    )
    args = parser.parse_args()
    model = Path(args.model)
    ensure_model(model)
    scenarios: dict[str, Callable[[Stack], Any]] = {
        "calm": lambda s: calm(s, model, args.calm_steps),
        "crash_rollout": lambda s: crash(s, model, "rollout-1"),
        "crash_trainer": lambda s: crash(s, model, "trainer-0"),
        "rollout_hang": lambda s: rollout_hang(s, model),
        "nan_loss": lambda s: nan_loss(s, model),
        "collective": lambda s: collective_hang(s, model),
    }
    results: list[Result] = []
    calm_line = ""
    for name, scenario in scenarios.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="robustrl-detect-") as tmp:
            stack = Stack(Path(tmp) / "home", Path(tmp) / "runs", DETECTION_ENV)
            trainers = "2" if name == "collective" else "1"  # a group of two ranks
            stack.cli("up", "--trainers", trainers, "--rollouts", "2")
            print(f"[{name}] running", flush=True)
            try:
                outcome = scenario(stack)
            finally:
                stack.cli("down")
        if name == "calm":
            count, took = outcome
            calm_line = (
                f"fault-free run: {args.calm_steps} steps in {took:.0f}s "
                f"(long tails x20, checkpoint every step, idle rollouts): "
                f"{count} incidents (false positives)"
            )
            print(calm_line, flush=True)
        else:
            results.append(outcome)
            print(f"[{name}] {outcome}", flush=True)

    print()
    print(f"{'failure':36} {'incident':16} {'latency s':>10} {'bound s':>8}  within  note")
    for r in results:
        latency = f"{r.latency:.2f}" if r.latency is not None else "-"
        ok = "yes" if r.ok else "NO"
        print(f"{r.kind:36} {r.incident:16} {latency:>10} {r.bound:>8.2f}  {ok:6}  {r.note}")
    if calm_line:
        print(calm_line)
    print(
        f"settings: TTL {TTL:.0f}s, silence window {SILENCE}s, "
        f"probe {PROBE_WAIT}+{PROBE_DEADLINE}s, collective budget {COLLECTIVE_BUDGET}s, "
        "heartbeat 0.5s"
    )


if __name__ == "__main__":
    main()
