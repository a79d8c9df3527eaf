"""ETTR under the same seeded fault schedule: role-based recovery against full restart.

Each mode runs the same job on a fresh local stack (real etcd, coordinators, monitor, 1 trainer
+ 2 warm standby trainers, 2 rollouts + 1 warm standby rollout; replacements and refilled
standbys come from the local provisioner) while
`robustrl chaos` injects, on seeded schedules, one trainer kill per 10% of the steps and one
rollout kill per 25%. Full restart stops every role's process and binds new ones (a warm
standby trainer, provisioned rollouts), as a restart from the last checkpoint does. A third
run of the same job without faults is the reference: its ETTR is the ceiling that start-up
and pipeline bubbles leave on this machine. It prints, side by
side, each run's ETTR (kept progress / wall time, from the coordinator's account), its goodput
(the fault-free run's wall time / its own, for the same job on the same stack and machine), the
end-to-end time, the recovery times, and the ratios; and, for each rollout loss, the seconds
from its detection to the replacement's first batch (a standby's, or a cold one's).

Two standbys, because at 300 steps the schedule kills the trainer every 4-9 s, and on two
busy cores a new standby takes about 10 s to start and build the model: with one, most
takeovers find the next standby still starting (measured when kills came every 7-9 s: ETTR
68.5% with one, 90.4% with two, seed 11). `--standby-trainers 1` runs the one-standby case.

    python benchmarks/ettr.py                      # 300 steps per mode
    python benchmarks/ettr.py --steps 150 --seed 3
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from local_stack import EXAMPLE, REPO, Stack, ensure_model

FIRST_BATCH = re.compile(r"rollout\.first_batch .*\bat=([0-9.]+)")


def rollout_takeovers(recoveries: list[dict[str, Any]], logs: Path) -> dict[str, list[float]]:
    """Seconds from each rollout loss's detection to its replacement's first batch (generated
    with the newest weights: a rollout pulls them before it generates), for replacements that
    were standbys and those started cold, from the replacements' own logs."""
    out: dict[str, list[float]] = {"standby": [], "cold": []}
    for rec in recoveries:
        if rec["role"] != "rollout" or not rec["replacements"]:
            continue
        name = rec["replacements"][0]
        log = logs / f"{name}.log"
        found = FIRST_BATCH.search(log.read_text()) if log.exists() else None
        if found is not None:
            kind = "standby" if name.startswith("standby-rollout") else "cold"
            out[kind].append(float(found.group(1)) - rec["detected_at"])
    return out


STARTED = re.compile(r"provision\.started .*\bhow=(\w+)")


def provisioned_starts(logs: Path) -> dict[str, int]:
    """How many members the leader's local provisioner started, by how (forked from the warm
    template, or fresh interpreters), from the coordinators' logs."""
    out: dict[str, int] = {}
    for log in logs.glob("coordinator-*.log"):
        for found in STARTED.finditer(log.read_text()):
            out[found.group(1)] = out.get(found.group(1), 0) + 1
    return out


def run_mode(
    mode: str,
    model: Path,
    steps: int,
    seed: int,
    *,
    faults: bool,
    standbys: int,
    standby_rollouts: int,
    template: bool,
    keep: Path | None = None,
) -> dict[str, Any]:
    name = mode if faults else "fault_free"
    with tempfile.TemporaryDirectory(prefix=f"robustrl-ettr-{name}-") as tmp:
        env = {"ROBUSTRL_COORDINATOR_PROVISION_TEMPLATE": str(template).lower()}
        stack = Stack(Path(tmp) / "home", Path(tmp) / "runs", env)
        stack.cli(
            "up",
            "--trainers",
            "1",
            "--standby-trainers",
            str(standbys),
            "--rollouts",
            "2",
            "--standby-rollouts",
            str(standby_rollouts),
        )
        try:
            job = f"ettr-{name.replace('_', '-')}"
            stack.cli(
                "submit",
                str(EXAMPLE),
                "--id",
                job,
                f"model.path={model}",
                f"trainer.steps={steps}",
                "trainer.groups_per_step=16",
                "trainer.eval_every=1000",
                f"recovery.mode={mode}",
            )
            started = time.monotonic()
            schedule = [("trainer", "10", seed), ("rollout", "25", seed + 1)] if faults else []
            chaos = [
                stack.background(
                    "chaos",
                    job,
                    "--role",
                    role,
                    "--fault",
                    "kill",
                    "--every-pct",
                    pct,
                    "--seed",
                    str(role_seed),
                )
                for role, pct, role_seed in schedule
            ]
            watch = subprocess.run(
                Stack.argv("watch", job),
                capture_output=True,
                text=True,
                env=stack.env,
                cwd=REPO,
                timeout=7200,
            )
            took = time.monotonic() - started
            injected = []
            for proc in chaos:
                out, _ = proc.communicate(timeout=60)
                injected += [line for line in out.splitlines() if " at step " in line]
            status = json.loads(stack.cli("status", job, "--json"))
            takeovers = rollout_takeovers(status["recoveries"], Path(tmp) / "home" / "logs")
            starts = provisioned_starts(Path(tmp) / "home" / "logs")
        finally:
            stack.cli("down")
            if keep is not None:
                shutil.copytree(Path(tmp) / "home" / "logs", keep / name / "logs")
                shutil.copytree(Path(tmp) / "runs", keep / name / "runs")
    recoveries = [r["recovery_s"] for r in status["recoveries"] if r.get("recovery_s")]
    ettr = status["ettr"] or {}
    return {
        "mode": name,
        "phase": status["phase"],
        "watch_rc": watch.returncode,
        "wall_s": took,
        "ettr": ettr.get("ettr", 0.0),
        "effective_s": ettr.get("effective_s", 0.0),
        "rolled_back_steps": ettr.get("rolled_back_steps", 0),
        "stalled_s": ettr.get("stalled_s", 0.0),
        "faults": len(injected),
        "recoveries": len(recoveries),
        "recovery_median_s": statistics.median(recoveries) if recoveries else None,
        "recovery_max_s": max(recoveries) if recoveries else None,
        "eval": status["metrics"].get("eval_reward"),
        "rollout_takeover_s": takeovers,
        "starts": starts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / ".robustrl" / "models" / "tiny-qwen"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--standby-trainers",
        type=int,
        default=2,
        help="warm standby trainers the stack keeps (each mode gets the same; see the doc)",
    )
    parser.add_argument(
        "--standby-rollouts",
        type=int,
        default=1,
        help="warm standby rollouts the stack keeps (each mode gets the same)",
    )
    parser.add_argument(
        "--no-template",
        dest="template",
        action="store_false",
        help="start every provisioned member as a fresh interpreter (the coordinator's "
        "provision_template off), to measure what the warm template saves",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="copy each run's logs and run folder here"
    )
    args = parser.parse_args()
    model = Path(args.model)
    ensure_model(model)
    rows = []
    for mode, faults in (("role_based", False), ("role_based", True), ("full_restart", True)):
        what = "under the fault schedule" if faults else "without faults"
        print(f"[{mode}] running {args.steps} steps {what}", flush=True)
        rows.append(
            run_mode(
                mode,
                model,
                args.steps,
                args.seed,
                faults=faults,
                standbys=args.standby_trainers,
                standby_rollouts=args.standby_rollouts,
                template=args.template,
                keep=args.keep,
            )
        )
        print(f"[{rows[-1]['mode']}] {rows[-1]}", flush=True)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    reference, role, full = rows

    def goodput(row: dict[str, Any]) -> str:
        return f"{reference['wall_s'] / row['wall_s']:.2f}" if row["wall_s"] else "-"

    print()
    print(
        f"{'mode':14} {'phase':10} {'ETTR':>7} {'goodput':>7} {'wall s':>8} {'faults':>7} "
        f"{'recovery med s':>15} {'max s':>7} {'steps lost':>10} {'stalled s':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:14} {r['phase']:10} {100 * r['ettr']:>6.1f}% {goodput(r):>7} "
            f"{r['wall_s']:>8.0f} "
            f"{r['faults']:>7} {fmt(r['recovery_median_s'], '.1f'):>15} "
            f"{fmt(r['recovery_max_s'], '.1f'):>7} {r['rolled_back_steps']:>10} "
            f"{r['stalled_s']:>9.0f}"
        )
    if full["ettr"] and full["wall_s"]:
        print(
            f"ETTR role-based / full restart: {role['ettr'] / full['ettr']:.2f}x; "
            f"end-to-end time full restart / role-based: {full['wall_s'] / role['wall_s']:.2f}x"
        )
    for r in (role, full):
        how = ", ".join(f"{n} {kind}" for kind, n in sorted(r["starts"].items())) or "none"
        print(f"{r['mode']}: members the provisioner started: {how}")
        for kind, seconds in r["rollout_takeover_s"].items():
            if seconds:
                print(
                    f"{r['mode']}: rollout loss detected -> {kind} replacement generating: "
                    f"median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s "
                    f"({len(seconds)} losses)"
                )
    if reference["wall_s"]:
        print(
            f"end-to-end time over the fault-free run: role-based "
            f"{role['wall_s'] / reference['wall_s']:.2f}x, full restart "
            f"{full['wall_s'] / reference['wall_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
