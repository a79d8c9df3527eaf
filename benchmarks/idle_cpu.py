"""CPU time of weight-plane processes that have little or nothing to do.

Real processes (tests/support/ucx_peer.py, the peer the UCX transport tests drive: a
UcxTransport in its own process) on an etcd of this run's own. Three measurements:

  idle after moving weights    a trainer published a version and a puller pulled it; once the
                               puller has given its endpoint back (PARK_SECONDS), the CPU
                               seconds each uses in an idle window of --window seconds
  holder with a parked puller  the same, with the puller keeping its endpoint (park 60 s): the
                               trainer waits for a next request that does not come
  trainer serving pulls        a warm puller pulls a --bulk-mib version --pulls times in a row
                               from the trainer, in --bucket-mib buckets: the trainer's CPU
                               seconds against the pulls' seconds (within one host the puller
                               copies the bytes, and the holder only hears that each is done)

Each figure is the median of --repeat runs, and each row gives CPU seconds over wall seconds.
The bounds are the ones the UCX transport tests asserted before CPU time moved here
(docs/decisions/0114): an idle process uses under 0.3 s of CPU in a 2 s window (0.15 of the
window, whatever --window is), and a trainer uses under half the seconds of the pulls it
serves. A row over its bound is marked BROKEN and the script exits with status 3.

    python benchmarks/idle_cpu.py
    python benchmarks/idle_cpu.py --repeat 5 --window 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from children import Child, start_etcd, stop_etcd  # noqa: E402 (a sibling script's module)

MIB = 1 << 20
IDLE_BOUND = 0.3 / 2.0
"""CPU seconds per second an idle process may use: 0.3 s in a 2 s window."""
SERVING_BOUND = 0.5
"""A serving trainer's CPU seconds per second of the pulls it serves."""
BOUND_BROKEN = 3
"""Exit status when a row is over its bound (a crash exits 1)."""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Peer(Child):
    """One ucx_peer process (tests/support/ucx_peer.py)."""

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)


class Bench:
    """An etcd of the run's own and the peers it starts (each stopped by pid at the end)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.endpoints = ""
        self.etcd: subprocess.Popen[bytes] | None = None
        self.peers: list[Peer] = []

    def start_etcd(self) -> None:
        self.etcd, self.endpoints = start_etcd(self.workdir)

    async def spawn(self, job: str, *specs: tuple[str, ...]) -> list[Peer]:
        """Peers of one job started side by side (imports dominate), ready: (name, *flags)."""
        group = []
        for name, *flags in specs:
            log = self.workdir / f"{job}-{name}.log"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *("-m", "tests.support.ucx_peer", "--endpoints", self.endpoints),
                *("--prefix", "/bench", "--job", job, "--instance", name, *flags),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log.open("wb"),
            )
            group.append(Peer(name, proc, log))
        self.peers.extend(group)
        for peer in group:
            ready = await peer.line(120)
            assert ready.get("event") == "ready", ready
        return group

    async def close(self) -> None:
        await asyncio.gather(*(peer.stop() for peer in self.peers))
        stop_etcd(self.etcd)


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)


async def idle_window(window: float, *peers: Peer) -> dict[str, float]:
    """CPU seconds each peer uses in `window` seconds of doing nothing."""
    before = {peer.name: peer.cpu() for peer in peers}
    await asyncio.sleep(window)  # the window measured, not a wait for a condition
    return {peer.name: peer.cpu() - before[peer.name] for peer in peers}


async def idle_after_moving_weights(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    trainer, puller = await bench.spawn("idle", ("trainer",), ("puller",))
    used: dict[str, list[float]] = {"trainer": [], "puller": []}
    for version in range(1, args.repeat + 1):
        await trainer.call("publish", version=version, seed=version)
        assert (await puller.call("pull", version=version))["ok"]

        async def unparked() -> bool:
            return (await trainer.call("state"))["serving"] == 0

        await until(unparked, timeout=30)
        for name, seconds in (await idle_window(args.window, trainer, puller)).items():
            used[name].append(seconds)
    return used


async def holder_with_a_parked_puller(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    trainer, puller = await bench.spawn("parked", ("trainer",), ("puller", "--park-seconds", "60"))
    used: dict[str, list[float]] = {"trainer": [], "puller": []}
    for version in range(1, args.repeat + 1):
        await trainer.call("publish", version=version, seed=version)
        assert (await puller.call("pull", version=version))["ok"]
        for name, seconds in (await idle_window(args.window, trainer, puller)).items():
            used[name].append(seconds)
        if (await trainer.call("state"))["serving"] != 1:
            raise RuntimeError("the puller's endpoint was not parked all along")
    return used


async def trainer_serving_pulls(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    buckets = ("--bucket-bytes", str(args.bucket_mib * MIB))
    trainer, puller = await bench.spawn(
        "serving", ("trainer", *buckets), ("puller", *buckets, "--no-relay")
    )
    await trainer.call("publish", version=1, seed=4, bulk_mib=args.bulk_mib)
    first = await puller.call("pull", version=1)  # endpoint and buffer warm
    assert first["ok"]
    served = first["counters"]["bytes_by_source"]["trainer"]
    trainer_s: list[float] = []
    pulling_s: list[float] = []
    per_gb: list[float] = []
    for _ in range(args.repeat):
        before, pulls = trainer.cpu(), 0.0
        for _ in range(args.pulls):
            pulled = await puller.call("pull", version=1)
            assert pulled["ok"]
            pulls += pulled["seconds"]
        used = trainer.cpu() - before  # while pulls ran, and in between
        now = pulled["counters"]["bytes_by_source"]["trainer"]
        trainer_s.append(used)
        pulling_s.append(pulls)
        per_gb.append(used / ((now - served) / 1e9))
        served = now
    return {"trainer": trainer_s, "pulling": pulling_s, "per_gb": per_gb}


def report(idle: dict[str, Any], parked: dict[str, Any], serving: dict[str, Any], args: Any) -> int:
    """Print every row; the number of rows over their bound."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nCPU time of weight-plane processes, median of {args.repeat} (GB = 1e9 B)")
    print(f"host: {os.cpu_count()} cpus, load average {load} (other work skews every row)")
    header = (
        f"{'measurement':<28} {'process':<8} {'CPU s':>7} {'of s':>7} {'CPU/s':>7}"
        f" {'bound':>8}  verdict"
    )
    print(header)
    print("-" * len(header))
    rows: list[tuple[str, str, float, float, float]] = []
    for label, used in (
        ("idle after moving weights", idle),
        ("holder with a parked puller", parked),
    ):
        for process in ("trainer", "puller"):
            rows.append((label, process, statistics.median(used[process]), args.window, IDLE_BOUND))
    rows.append(
        (
            "trainer serving pulls",
            "trainer",
            statistics.median(serving["trainer"]),
            statistics.median(serving["pulling"]),
            SERVING_BOUND,
        )
    )
    broken = 0
    for label, process, cpu, wall, bound in rows:
        ratio = cpu / wall if wall > 0 else float("inf")
        verdict = "ok" if ratio < bound else "BROKEN"
        broken += verdict != "ok"
        limit = f"< {bound:.3f}"
        print(
            f"{label:<28} {process:<8} {cpu:>7.3f} {wall:>7.3f} {ratio:>7.3f} {limit:>8}  {verdict}"
        )
    print(
        f"trainer serving pulls: {statistics.median(serving['per_gb']):.3f} CPU s per GB served"
        f" ({args.pulls} pulls of {args.bulk_mib} MiB in {args.bucket_mib} MiB buckets a repeat)"
    )
    return broken


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="idle-cpu-") as tmp:
        bench = Bench(Path(tmp))
        bench.start_etcd()
        try:
            idle = await idle_after_moving_weights(bench, args)
            parked = await holder_with_a_parked_puller(bench, args)
            serving = await trainer_serving_pulls(bench, args)
        finally:
            await bench.close()
    broken = report(idle, parked, serving, args)
    return BOUND_BROKEN if broken else 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--window", type=float, default=2.0, help="idle seconds measured")
    parser.add_argument("--pulls", type=int, default=8, help="pulls served per repeat")
    parser.add_argument("--bulk-mib", type=int, default=256, help="the pulled version's bulk")
    parser.add_argument("--bucket-mib", type=int, default=32)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.pulls < 1:
        parser.error("--repeat and --pulls must be at least 1")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args(sys.argv[1:]))))
