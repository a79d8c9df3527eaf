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
end-to-end time, the recovery times, and the ratios; for each rollout loss, the seconds
from its detection to the replacement's first batch (a standby's, or a cold one's); and where
each faulted run's extra seconds over the fault-free run went, cut along the trainer's kept
steps (metrics.jsonl) so that the parts add up to the gap. The three runs are repeated
(`--repeats`, seed SEED+i for repeat i) and the medians printed: one run on a shared host
moves by 10-20%.

Two standbys, because at 300 steps the schedule kills the trainer every 4-9 s, and on two
busy cores a new standby takes about 10 s to start and build the model: with one, most
takeovers find the next standby still starting (measured when kills came every 7-9 s: ETTR
68.5% with one, 90.4% with two, seed 11). `--standby-trainers 1` runs the one-standby case.

    python benchmarks/ettr.py                      # 300 steps per mode, 3 repeats
    python benchmarks/ettr.py --steps 1500         # the 5x longer job, the same faults
    python benchmarks/ettr.py --steps 150 --seed 3 --repeats 1
"""

from __future__ import annotations

import argparse
import itertools
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


def step_rows(metrics: Path) -> list[dict[str, float]]:
    """The kept steps' times, one row per step (the last written: a restore rewrites the steps
    after its checkpoint), in step order."""
    rows: dict[int, dict[str, float]] = {}
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        row = json.loads(line)
        if "step_started_at" in row:
            rows[int(row["step"])] = row
    return [rows[step] for step in sorted(rows)]


def injections(out: str) -> list[dict[str, Any]]:
    """What `robustrl chaos --json` injected: its JSON list, among its commentary (stderr,
    merged: a line may come after the list too). ValueError, with the output, if none."""
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(out)) if out[i] == "[" and (i == 0 or out[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            found, _ = decoder.raw_decode(out, start)
        except ValueError:
            continue
        if isinstance(found, list):
            return found
    raise ValueError(f"no injection list in chaos's output: {out[-2000:]!r}")


def with_failure_times(
    incidents: list[dict[str, Any]], injected: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each incident with `failed_at`: the last injection into its instance before it was
    detected (the coordinator does not know when a fault began)."""
    out = []
    for incident in incidents:
        before = [
            i["at"]
            for i in injected
            if i["instance_id"] == incident["instance_id"] and i["at"] <= incident["detected_at"]
        ]
        out.append({**incident, "failed_at": max(before) if before else None})
    return out


def covered(spans: list[tuple[float, float]], within: list[tuple[float, float]]) -> float:
    """Seconds of `within` (disjoint) that the union of `spans` covers."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return sum(max(0.0, min(end, b) - max(start, a)) for start, end in merged for a, b in within)


def timeline(
    rows: list[dict[str, float]],
    submitted_at: float,
    ended_at: float,
    incidents: list[dict[str, Any]],
    rolled_back_s: float,
) -> dict[str, float]:
    """The run's wall time cut along the trainer's kept steps, parts that add up to it:
    before the first step, waiting for each step's data, the steps' work, the gaps between
    kept steps, and after the last step. Within the gaps (no step made): failures being
    detected (from the fault to the incident), recoveries (from the incident to the job
    running again; a full restart's too, whatever role failed), and the steps thrown away."""
    if not rows:
        return {"before": ended_at - submitted_at}
    gaps = [(a["step_ended_at"], b["step_started_at"]) for a, b in itertools.pairwise(rows)]
    detecting = [(i["failed_at"], i["detected_at"]) for i in incidents if i.get("failed_at")]
    recovering = [(i["detected_at"], i["recovered_at"]) for i in incidents if i.get("recovered_at")]
    detection = covered(detecting, gaps)
    return {
        "before": rows[0]["step_started_at"] - submitted_at,
        "wait": sum(r["step_work_started_at"] - r["step_started_at"] for r in rows),
        "work": sum(r["step_ended_at"] - r["step_work_started_at"] for r in rows),
        "gaps": sum(b - a for a, b in gaps),
        "gap_detection": detection,
        "gap_recovery": covered(detecting + recovering, gaps) - detection,
        "gap_rolled_back": rolled_back_s,
        "after": ended_at - rows[-1]["step_ended_at"],
    }


ATTRIBUTION = (
    ("starting the job (to its first step)", "before"),
    ("waiting for data beyond the fault-free run's", "wait"),
    ("slower steps (shared cores: process starts, pulls)", "work"),
    ("no step made: failures being detected", "gap_detection"),
    ("no step made: recoveries (fence, bind, restart)", "gap_recovery"),
    ("no step made: steps rolled back", "gap_rolled_back"),
    ("no step made: restore, lost partial steps, rest", "gap_rest"),
    ("ending (last step to the job's end)", "after"),
)


def attribution(reference: dict[str, float], run: dict[str, float]) -> dict[str, float]:
    """Where the run's extra wall time over the fault-free run went; the parts add up to it
    (the fault-free run's own gaps, normally none, are taken off the rest)."""
    parts = {
        key: run.get(key, 0.0) - reference.get(key, 0.0)
        for key in ("before", "wait", "work", "after")
    }
    named = ("gap_detection", "gap_recovery", "gap_rolled_back")
    parts |= {key: run.get(key, 0.0) for key in named}
    parts["gap_rest"] = (
        run.get("gaps", 0.0) - reference.get("gaps", 0.0) - sum(run.get(k, 0.0) for k in named)
    )
    return parts


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
    standby_nice: int | None,
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
            *([] if standby_nice is None else ["--standby-nice", str(standby_nice)]),
            *([] if template else ["--no-template"]),
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
            started, submitted_at = time.monotonic(), time.time()
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
                    "--json",
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
            took, ended_at = time.monotonic() - started, time.time()
            injected = []
            for proc in chaos:
                out, _ = proc.communicate(timeout=60)
                injected += injections(out)
            status = json.loads(stack.cli("status", job, "--json"))
            takeovers = rollout_takeovers(status["recoveries"], Path(tmp) / "home" / "logs")
            starts = provisioned_starts(Path(tmp) / "home" / "logs")
            steps_made = step_rows(Path(tmp) / "runs" / job / "metrics.jsonl")
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
        "timeline": timeline(
            steps_made,
            submitted_at,
            ended_at,
            with_failure_times(ettr.get("incidents", []), injected),
            ettr.get("rolled_back_s", 0.0),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / ".robustrl" / "models" / "tiny-qwen"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="run the three modes this many times, repeat i with seed SEED+i; medians decide",
    )
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
        help="start every member as a fresh interpreter (`robustrl up --no-template`), "
        "to measure what the warm template saves",
    )
    parser.add_argument(
        "--standby-nice",
        type=int,
        default=None,
        help="`robustrl up --standby-nice`: how much nicer standbys run until bound (default: "
        "up's own, 10 where they may go back); 0 measures standbys competing as equals",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="copy each run's logs and run folder here"
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 10:
        parser.error("--repeats must be at least 1 and --steps at least 10")
    model = Path(args.model)
    ensure_model(model)
    repeats: list[list[dict[str, Any]]] = []
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        rows = []
        for mode, faults in (("role_based", False), ("role_based", True), ("full_restart", True)):
            what = "under the fault schedule" if faults else "without faults"
            print(f"[{repeat + 1}/{args.repeats} seed {seed}] {mode}: {args.steps} steps {what}")
            keep = args.keep / f"repeat-{repeat + 1}" if args.keep is not None else None
            rows.append(
                run_mode(
                    mode,
                    model,
                    args.steps,
                    seed,
                    faults=faults,
                    standbys=args.standby_trainers,
                    standby_rollouts=args.standby_rollouts,
                    template=args.template,
                    standby_nice=args.standby_nice,
                    keep=keep,
                )
            )
            print(f"[{rows[-1]['mode']}] {json.dumps(rows[-1])}", flush=True)
        repeats.append(rows)
        report(rows, f"repeat {repeat + 1} (seed {seed})")
    if args.repeats > 1:
        report_medians(repeats)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(rows: list[dict[str, Any]], title: str) -> None:
    """One repeat's table, its rollout takeovers and how its members were started."""
    reference, role, full = rows
    print(f"\n{title}")
    print(
        f"{'mode':14} {'phase':10} {'ETTR':>7} {'goodput':>7} {'wall s':>8} {'faults':>7} "
        f"{'recovery med s':>15} {'max s':>7} {'steps lost':>10} {'stalled s':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:14} {r['phase']:10} {100 * r['ettr']:>6.1f}% "
            f"{reference['wall_s'] / r['wall_s']:>7.2f} {r['wall_s']:>8.0f} "
            f"{r['faults']:>7} {fmt(r['recovery_median_s'], '.1f'):>15} "
            f"{fmt(r['recovery_max_s'], '.1f'):>7} {r['rolled_back_steps']:>10} "
            f"{r['stalled_s']:>9.0f}"
        )
    for r in (role, full):
        how = ", ".join(f"{n} {kind}" for kind, n in sorted(r["starts"].items())) or "none"
        print(f"{r['mode']}: members the provisioner started: {how}")
        parts = attribution(reference["timeline"], r["timeline"])
        print(
            f"{r['mode']}: {r['wall_s'] - reference['wall_s']:.1f} s over the fault-free run: "
            + ", ".join(f"{key} {parts[key]:.1f}" for _, key in ATTRIBUTION)
        )
        for kind, seconds in r["rollout_takeover_s"].items():
            if seconds:
                print(
                    f"{r['mode']}: rollout loss detected -> {kind} replacement generating: "
                    f"median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s "
                    f"({len(seconds)} losses)"
                )


def report_medians(repeats: list[list[dict[str, Any]]]) -> None:
    """The medians over the repeats: what the benchmark's figures are."""

    def median(mode: int, value: Any) -> float:
        return statistics.median(value(rows[mode], rows) for rows in repeats)

    def goodput(row: dict[str, Any], rows: list[dict[str, Any]]) -> float:
        return float(rows[0]["wall_s"] / row["wall_s"])

    print(f"\nmedians of {len(repeats)} repeats")
    print(f"{'mode':14} {'ETTR':>7} {'goodput':>7} {'wall s':>8} {'recovery med s':>15}")
    names = ("fault_free", "role_based", "full_restart")
    for mode, name in enumerate(names):
        recovery = [r[mode]["recovery_median_s"] for r in repeats if r[mode]["recovery_median_s"]]
        print(
            f"{name:14} {100 * median(mode, lambda r, _: r['ettr']):>6.1f}% "
            f"{median(mode, goodput):>7.2f} {median(mode, lambda r, _: r['wall_s']):>8.0f} "
            f"{fmt(statistics.median(recovery) if recovery else None, '.2f'):>15}"
        )
    takeovers = [s for rows in repeats for s in rows[1]["rollout_takeover_s"]["standby"]]
    if takeovers:
        print(
            f"role-based: rollout loss detected -> standby generating: median "
            f"{statistics.median(takeovers):.2f} s over {len(takeovers)} losses"
        )
    for mode in (1, 2):
        print(f"\nwhere the {names[mode]} run's extra seconds went (median over repeats):")
        gap = median(mode, lambda r, rows: r["wall_s"] - rows[0]["wall_s"])
        parts = [attribution(rows[0]["timeline"], rows[mode]["timeline"]) for rows in repeats]
        for label, key in ATTRIBUTION:
            print(f"  {label:52} {statistics.median(p[key] for p in parts):>7.1f} s")
        totals = [sum(p.values()) for p in parts]
        print(f"  {'sum of the parts':52} {statistics.median(totals):>7.1f} s (gap {gap:.1f} s)")
    print(
        f"\nETTR role-based / full restart: "
        f"{median(1, lambda r, _: r['ettr']) / median(2, lambda r, _: r['ettr']):.2f}x; "
        f"end-to-end time full restart / role-based: "
        f"{median(2, lambda r, _: r['wall_s']) / median(1, lambda r, _: r['wall_s']):.2f}x"
    )
    print(
        f"end-to-end time over the fault-free run: role-based "
        f"{median(1, lambda r, rows: r['wall_s'] / rows[0]['wall_s']):.2f}x, full restart "
        f"{median(2, lambda r, rows: r['wall_s'] / rows[0]['wall_s']):.2f}x"
    )


if __name__ == "__main__":
    main()
