"""What the work ledger costs etcd: writes and bytes per request, with and without shared writes.

A real etcd (a private one) and a real coordinator leader (ServiceRuntime, Leadership,
JobDriver), in this process. Each caller stands for a rollout: it leases groups, completes them
and has them trained, changing the ledger under the job's lock as lease_work, complete_work and
report_progress do. The ledger also lists `--background` groups out to other rollouts, so each
write is the size of a busy job's ledger. Two ways of storing each change, side by side:
  own      the caller waits for its write while holding the lock (how lease_work stored a
           lease before coordinator.coalesce): every change is a write of its own
  shared   the caller lets go of the lock and waits for a write that carries its change
           (JobDriver.ledger_changed, as lease_work and complete_work do now)

For each number of callers at once (`--callers`), one after the other in one run:
  changes/s      ledger changes stored per second (each awaited until a write carrying it landed)
  writes/change  writes of the ledger's key (etcd's own count: its version) per change
  KB/change      bytes sent to etcd per change (the stored ledger times writes/change)
  wait ms        median time from a change to its write landing
and shared against own at the same number of callers. Also printed: the ledger's size as JSON
and as stored (robustrl.contracts.packed).

    python benchmarks/ledger_writes.py                         # callers 1,4,16,64
    python benchmarks/ledger_writes.py --callers 1,64 --changes 3000 --json rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from robustrl.cli.stack import etcd_argv, etcd_healthy, free_port

    client, peer = free_port(), free_port()
    endpoints = f"127.0.0.1:{client}"
    proc = subprocess.Popen(
        [*etcd_argv("bench", workdir / "etcd", client, peer), "--log-level=error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not etcd_healthy(endpoints):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("etcd did not start")
        time.sleep(0.1)
    return proc, endpoints


async def measure(args: argparse.Namespace, endpoints: str) -> list[dict[str, Any]]:
    from robustrl.core.config import EtcdSettings
    from robustrl.core.logs import configure_logging
    from robustrl.core.runtime import ServiceRuntime
    from services.coordinator.config import CoordinatorSettings
    from services.coordinator.driver import JobDriver
    from services.coordinator.leadership import Leadership

    configure_logging(service="bench", instance="ledger", level="warning")
    etcd = EtcdSettings(endpoints=endpoints, prefix="/bench")
    settings = CoordinatorSettings(instance_id="coordinator-bench")
    runtime = ServiceRuntime("coordinator", settings, etcd, service_names=[])
    leading = asyncio.Event()

    async def elected() -> None:
        await driver.on_elected()
        leading.set()

    leadership = Leadership(runtime, "bench", elected)
    driver = JobDriver(runtime, leadership, tick_interval=3600, lease_seconds=60)
    await runtime.start()
    leadership.start()
    rows = []
    try:
        await asyncio.wait_for(leading.wait(), 30)
        runs = [(c, mode) for c in args.callers for mode in ("own", "shared")]
        for run, (callers, mode) in enumerate(runs):
            rows.append(await one_run(args, driver, f"bench-{run}", callers, mode))
            print(f"  measured {callers} caller(s) at once, {mode} writes", flush=True)
    finally:
        await leadership.resign()
        await driver.stop()
        await runtime.shutdown()
    return rows


async def one_run(
    args: argparse.Namespace, driver: Any, job: str, callers: int, mode: str
) -> dict[str, Any]:
    """`callers` rollouts at once on a new job's ledger, storing each change the `mode` way."""
    from robustrl.contracts import packed
    from services.coordinator import work

    client, key = driver.runtime.client, driver.runtime.keys.work(job)
    lock = asyncio.Lock()
    ledger = work.WorkLedger(job_id=job)
    work.lease(
        ledger,
        instance_id="background",
        epoch=1,
        max_groups=args.background,
        budget=10**9,
        now=time.time(),
        lease_seconds=3600,
    )
    await driver.save_ledger(ledger)
    first = await client.get(key)
    per_caller = max(1, args.changes // (3 * callers))
    steps = [0]
    latencies: list[float] = []

    async def change(apply: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        async with lock:
            result = apply()
            if mode == "own":
                await driver.save_ledger(ledger)
            else:
                saved = driver.ledger_changed(ledger)
        if mode == "shared":
            await saved
        latencies.append(time.perf_counter() - began)
        return result

    def trained(groups: list[str]) -> None:
        steps[0] += 1
        work.record_progress(ledger, groups, {}, step=steps[0], durable=steps[0] + 1)

    async def rollout(name: str) -> None:
        for _ in range(per_caller):
            groups = await change(
                functools.partial(
                    work.lease,
                    ledger,
                    instance_id=name,
                    epoch=1,
                    max_groups=args.groups,
                    budget=10**9,
                    now=time.time(),
                    lease_seconds=60,
                )
            )
            await change(functools.partial(work.complete, ledger, name, groups))
            await change(functools.partial(trained, groups))

    began = time.perf_counter()
    await asyncio.gather(*(rollout(f"rollout-{n:03d}") for n in range(callers)))
    took = time.perf_counter() - began
    last = await client.get(key)
    changes = 3 * per_caller * callers
    writes = last.version - first.version
    return {
        "callers": callers,
        "mode": mode,
        "changes": changes,
        "seconds": took,
        "changes_per_s": changes / took,
        "writes_per_change": writes / changes,
        "kb_per_change": len(last.value) * writes / changes / 1e3,
        "wait_ms_median": 1e3 * statistics.median(latencies),
        "json_kb": len(ledger.model_dump_json()) / 1e3,
        "stored_kb": len(packed.dump(ledger)) / 1e3,
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import os

    print()
    print(
        f"work ledger writes to one real etcd, {args.background} groups out in the background, "
        f"{args.groups} groups a lease; 2 changes out of 3 also move groups"
    )
    print(f"host: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    head = (
        f"{'callers':>8} {'writes':>7} {'changes':>8} {'changes/s':>10} {'writes/change':>14} "
        f"{'KB/change':>10} {'wait ms':>8} {'shared/own changes/s':>21}"
    )
    print(head)
    print("-" * len(head))
    own: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["mode"] == "own":
            own[row["callers"]] = row
            ratio = ""
        else:
            ratio = f"{row['changes_per_s'] / own[row['callers']]['changes_per_s']:.2f}"
        print(
            f"{row['callers']:>8} {row['mode']:>7} {row['changes']:>8} "
            f"{row['changes_per_s']:>10.0f} {row['writes_per_change']:>14.3f} "
            f"{row['kb_per_change']:>10.2f} {row['wait_ms_median']:>8.2f} {ratio:>21}"
        )
    last = rows[-1]
    print(
        "wait ms: median time from a change to its write landing. The ledger at the end: "
        f"{last['json_kb']:.1f} KB as JSON, {last['stored_kb']:.1f} KB stored "
        f"({last['json_kb'] / last['stored_kb']:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", default="1,4,16,64", help="callers at once, one run each")
    parser.add_argument("--changes", type=int, default=1500, help="ledger changes per run")
    parser.add_argument("--groups", type=int, default=4, help="groups per lease")
    parser.add_argument("--background", type=int, default=128, help="groups out meanwhile")
    parser.add_argument("--json", default="", help="also write every row to this file")
    args = parser.parse_args()
    args.callers = [int(c) for c in args.callers.split(",")]
    if not args.callers or min(args.callers) < 1:
        parser.error("--callers: positive whole numbers, comma-separated")
    workdir = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    proc, endpoints = start_etcd(workdir)
    try:
        rows = asyncio.run(measure(args, endpoints))
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
