"""The control plane under many members: coordinator read latency, monitor and etcd load,
crash detection at scale, and the monitor's memory once everyone has left.

One run on a local stack of its own (`robustrl up --coordinators 2 --monitors M`: real etcd,
coordinator and monitor processes, in a temporary ROBUSTRL_HOME) and a load generator of fake
rollout members in `--procs` child processes (each owns every P-th member; what a fake member
is, in benchmarks/fake_members.py). Each level also reports how late the generator's event
loop ran: a late generator sends late beats, and the monitor is then right to suspect its
members.

One grpc.aio server per member was measured before choosing it: 2,000 of them start in 0.6 s
and take 52 MiB and no CPU while idle, so each member has a real one and a killed member's
address refuses connections as a dead process's does.

Not like real members: the beats of one generator process share one HTTP/2 connection to the
monitor (gRPC pools connections to one address across channels), where real members each have
their own, and their leases are refreshed over one keepalive stream per generator process;
the work per stream, per beat and per refresh is the same, the cost per connection is not
measured. The measuring client runs in the parent process, apart from the generator, so its
latencies carry no lag of the generator's event loop (on a small host they carry the CPU
every process competes for: the leader's health check, measured beside the reads, shows how
much).

  ramp     for each of --levels: grow to that many members, wait until the monitors have
           beats from all of them (GetHealth) and the registry lists them, settle, then for
           --window seconds call the leader coordinator --rate times a second with each of
           ListJobs, GetJob (a job submitted and cancelled before the ramp) and ListMembers,
           and beside them its health check (Health: the floor the busy host sets, no etcd,
           no work): p50/p99 of each; that --repeats times (windows back to back), the
           medians of the windows' p50 and p99 reported, each window's p99 kept in --json;
           CPU% (/proc utime+stime over the windows; 100% is one core) and RSS of each
           monitor, the leader, etcd and the generator (its processes)
  cli      `robustrl members` (human and --json) at the top level, median of --cli-repeat
  kill     --kill-fraction of the members (seeded by --seed) die at once without a word:
           server closed (its address refuses), then at once its heartbeat stream cut without
           a goodbye and its lease keepalive stopped without revoking. For each, the time
           from its death (its listener closed) to its MEMBER_LOST incident reaching a watch
           of the incident log, and to the incident's detected_at; how many were reported,
           more than once, and by which evidence (address refused, reconnect grace, lease
           expired)
  leave    every other member leaves cleanly (goodbye, lease revoked); after --retention-wait
           seconds each monitor's RSS against its RSS before the ramp, and how many fake
           members it still lists (GetHealth)
  churn    every member joins again (the top level) and leaves again; after --retention-wait
           seconds each monitor's RSS against its RSS after the first leave: what it keeps
           for good per round of churn (the first round leaves what the allocator keeps of the
           first peak, see docs/decisions/0018)
  false    any incident about a member that was not killed, over the whole run

The verdicts at the end are printed as measured (the exit status does not depend on them):
RPC p99 under 50 ms at the top level; killed members reported within TTL + 1 s at p99; no
false incident; each monitor's RSS after everyone left within 10% of before the ramp; the
generator kept every lease (else the load was not the one measured).

    python benchmarks/control_plane.py                                # 500,1000,2000
    python benchmarks/control_plane.py --levels 2000 --window 10 --json cp.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from children import Child
from fake_members import FAKE, generator_main
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest
from local_stack import EXAMPLE, REPO, Stack

from robustrl.cli.stack import StackState
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.keys import KeySpace
from robustrl.core.channels import open_channel
from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.incident_log import IncidentLog
from robustrl.core.watch import list_prefix
from robustrl.v1 import coordinator_pb2 as pb
from robustrl.v1 import (
    coordinator_pb2_grpc,
    monitor_pb2,
    monitor_pb2_grpc,
)
from services.monitor.config import MonitorSettings

SCRIPT = Path(__file__).resolve()
JOB = "control-plane-bench"
RPCS = ("ListJobs", "GetJob", "ListMembers")
"""The reads measured against the leader (and judged); the health check beside them is not."""
RPC_P99_BOUND_MS = 50.0
RSS_GROWTH_BOUND = 0.10
CALL_DEADLINE = 10.0
HEALTH_PAGE = 1000
EVIDENCE = (
    ("refuses connections", "refused"),
    ("no reconnect", "grace"),
    ("lease expired", "lease"),
)
"""Words of a MEMBER_LOST incident's evidence -> which detector path found the member lost."""
"""Members per GetHealth answer (the monitor's largest page)."""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ---------------------------------------------------------------- the measuring parent


class Bench:
    def __init__(
        self, stack: Stack, home: Path, args: argparse.Namespace, coordinator: CoordinatorClient
    ) -> None:
        self.stack, self.home, self.args = stack, home, args
        state = StackState.load(home)
        assert state is not None, "the stack recorded nothing"
        self.state = state
        self.pids = {p.name: p.pid for p in state.procs}
        self.monitors = sorted(p.name for p in state.procs if p.role == "monitor")
        self.children: list[Child] = []
        self.incidents: list[tuple[float, str, IncidentRecord]] = []
        """(when it reached our watch, the run's phase then, the incident)."""
        self.phase = "start"
        self.coordinator = coordinator
        self.client = coordinator.etcd

    async def call(self, child: Child, cmd: str, **fields: Any) -> dict[str, Any]:
        reply = await child.call(cmd, **fields)
        if "error" in reply:
            raise RuntimeError(f"{child.name}: {reply['error']}\n{child.log.read_text()[-2000:]}")
        return reply

    async def spawn(self, workdir: Path) -> None:
        for n in range(self.args.procs):
            log = workdir / f"generator-{n}.log"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(SCRIPT),
                *("--child", str(n), "--endpoints", self.state.etcd_endpoints),
                *("--prefix", self.state.prefix, "--ttl", str(self.args.ttl)),
                *("--beat", str(self.args.beat)),
                *("--generator-nice", str(self.args.generator_nice)),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log.open("wb"),
            )
            self.children.append(Child(f"generator-{n}", proc, log))
        for child in self.children:
            ready = await child.line(120)
            assert ready.get("event") == "ready", ready

    async def on_children(self, cmd: str, indices: list[int] | None = None) -> list[dict[str, Any]]:
        """`cmd` on every child at once; `indices` go each to the child that owns them."""
        procs = len(self.children)
        return await asyncio.gather(
            *(
                self.call(child, cmd, **({} if indices is None else {"indices": mine}))
                for n, child in enumerate(self.children)
                for mine in [[i for i in indices or [] if i % procs == n]]
            )
        )

    async def follow_incidents(self, after_revision: int) -> None:
        log = IncidentLog(self.client, self.coordinator.keys)
        async for record in log.follow("", after_revision):
            self.incidents.append((time.time(), self.phase, record))

    async def health(self) -> dict[str, list[monitor_pb2.MemberHealth]]:
        """The members each monitor watches (GetHealth, every page), by monitor instance id."""
        monitors, _ = await self.coordinator.registry.list("monitor")
        out: dict[str, list[monitor_pb2.MemberHealth]] = {}
        for monitor in monitors:
            out[monitor.instance_id] = views = []
            async with open_channel(monitor.address) as channel:
                stub, token = monitor_pb2_grpc.MonitorStub(channel), ""
                while True:
                    reply = await stub.GetHealth(
                        monitor_pb2.GetHealthRequest(page_size=HEALTH_PAGE, page_token=token),
                        timeout=CALL_DEADLINE,
                    )
                    views += reply.members
                    if not (token := reply.next_page_token):
                        break
        return out

    async def until_seen(self, level: int) -> dict[str, Any]:
        """Until the registry lists `level` fake members and the monitors, together, have had
        beats (counters) from each of them, or a deadline: how many were, and in which state
        the monitors hold the fake members (a member once declared lost stays so)."""
        deadline = time.monotonic() + 60 + level / 10
        while True:
            members, _ = await self.coordinator.registry.list("rollout")
            registered = sum(m.instance_id.startswith(FAKE) for m in members)
            views = [
                view
                for held in (await self.health()).values()
                for view in held
                if view.instance_id.startswith(FAKE)
            ]
            beating = {view.instance_id for view in views if view.counters}
            states = collections.Counter(view.state for view in views)
            done = registered == level and len(beating) >= level
            if done or time.monotonic() > deadline:
                return {"registered": registered, "seen": len(beating), "states": dict(states)}
            await asyncio.sleep(1.0)

    async def rpc_window(self, address: str) -> dict[str, dict[str, Any]]:
        """Each of the three reads `--rate` times a second for `--window` seconds, one call of
        each at a time, on a fixed clock (a call that overruns its period delays the next)."""
        period = 1.0 / self.args.rate
        async with open_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            reads: dict[str, Callable[[], Awaitable[Any]]] = {
                "ListJobs": lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=CALL_DEADLINE),
                "GetJob": lambda: stub.GetJob(pb.GetJobRequest(job_id=JOB), timeout=CALL_DEADLINE),
                "ListMembers": lambda: stub.ListMembers(
                    pb.ListMembersRequest(), timeout=CALL_DEADLINE
                ),
                # The floor: the same process's health check, no etcd, no work. What the three
                # take above it is theirs; what it takes itself is the busy host's.
                "Health": lambda: health.Check(HealthCheckRequest(), timeout=CALL_DEADLINE),
            }
            for read in reads.values():  # channel connected, first-call costs out of the window
                await read()
            start = time.monotonic()
            end = start + self.args.window

            async def paced(read: Callable[[], Awaitable[Any]], offset: float) -> dict[str, Any]:
                latencies: list[float] = []
                errors: list[str] = []
                due = start + offset
                while due < end:
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    began = time.perf_counter()
                    try:
                        await read()
                        latencies.append(time.perf_counter() - began)
                    except grpc.aio.AioRpcError as exc:
                        errors.append(exc.code().name)
                    due = max(due + period, time.monotonic())
                ms = [1e3 * s for s in latencies]
                return {
                    "calls": len(ms),
                    "errors": errors,
                    "p50_ms": percentile(ms, 50),
                    "p99_ms": percentile(ms, 99),
                    "max_ms": max(ms, default=float("nan")),
                }

            results = await asyncio.gather(
                *(paced(read, n * period / len(reads)) for n, read in enumerate(reads.values()))
            )
        return dict(zip(reads, results, strict=True))

    async def rpc_windows(self, address: str) -> dict[str, dict[str, Any]]:
        """`--repeats` windows one after another: each read's p50 and p99 are the medians of
        the windows' (one busy moment of a shared host moves one window's tail, not the
        median), with every window's p99 kept beside them."""
        windows = [await self.rpc_window(address) for _ in range(self.args.repeats)]
        out = {}
        for name in windows[0]:
            each = [w[name] for w in windows]
            out[name] = {
                "calls": sum(w["calls"] for w in each),
                "errors": [e for w in each for e in w["errors"]],
                "p50_ms": statistics.median(w["p50_ms"] for w in each),
                "p99_ms": statistics.median(w["p99_ms"] for w in each),
                "p99_each_ms": [w["p99_ms"] for w in each],
                "max_ms": max(w["max_ms"] for w in each),
            }
        return out

    async def generator_status(self) -> dict[str, Any]:
        """Leases its members lost so far, and its loop's worst lateness since last asked."""
        statuses = await self.on_children("status")
        return {
            "leases_lost": sum(s["leases_lost"] for s in statuses),
            "lag_max_s": max(s["lag_max_s"] for s in statuses),
        }

    async def level(self, members: int) -> dict[str, Any]:
        self.phase = f"ramp to {members}"
        began = time.monotonic()
        grown = await self.on_children("grow", list(range(members)))
        ramp_s = time.monotonic() - began
        seen = await self.until_seen(members)
        seen_s = time.monotonic() - began
        if seen["seen"] < members:
            print(f"  {members} members: only {seen} after {seen_s:.0f} s", flush=True)
        await asyncio.sleep(self.args.settle)  # let the ramp's own work drain first
        leader = await self.coordinator.leader()
        assert leader is not None, "no leader coordinator"
        procs = {
            **{m: self.pids[m] for m in self.monitors},
            "leader": self.pids[leader["instance_id"]],
            "etcd": self.pids["etcd"],
            **{c.name: c.proc.pid for c in self.children},
        }
        ramp_status = await self.generator_status()
        self.phase = f"window at {members}"
        cpu_before, wall_before = {n: cpu_seconds(p) for n, p in procs.items()}, time.monotonic()
        rpc = await self.rpc_windows(leader["address"])
        wall = time.monotonic() - wall_before
        status = await self.generator_status()
        cpu = {n: 100 * (cpu_seconds(p) - cpu_before[n]) / wall for n, p in procs.items()}
        rss = {n: rss_mib(p) for n, p in procs.items()}
        generators = [c.name for c in self.children]
        return {
            "members": members,
            "load_avg": os.getloadavg()[0],
            "ramp_s": ramp_s,
            "seen_s": seen_s,
            "grow_s": max(g["seconds"] for g in grown),
            **seen,
            "rpc": rpc,
            "monitors": {m: {"cpu_pct": cpu[m], "rss_mib": rss[m]} for m in self.monitors},
            "leader": {
                "instance_id": leader["instance_id"],
                "cpu_pct": cpu["leader"],
                "rss_mib": rss["leader"],
            },
            "etcd": {"cpu_pct": cpu["etcd"], "rss_mib": rss["etcd"]},
            "generator": {
                "cpu_pct": sum(cpu[g] for g in generators),
                "rss_mib": sum(rss[g] for g in generators),
                "procs": len(generators),
                "leases_lost": status["leases_lost"],
                "lag_max_s": status["lag_max_s"],
                "ramp_lag_max_s": ramp_status["lag_max_s"],
            },
        }

    async def time_cli(self) -> dict[str, float]:
        """`robustrl members`, human output and --json: the median seconds of each."""
        out = {}
        for label, flags in (("human_s", []), ("json_s", ["--json"])):
            took = []
            for _ in range(self.args.cli_repeat):
                began = time.perf_counter()
                await asyncio.to_thread(self.stack.cli, "members", *flags)
                took.append(time.perf_counter() - began)
            out[label] = statistics.median(took)
        return out

    def lost_reports(self, killed: dict[str, float]) -> dict[str, list[tuple[float, Any]]]:
        """The incidents about each killed member that came after it was killed."""
        reports: dict[str, list[tuple[float, Any]]] = {name: [] for name in killed}
        for seen_at, _, record in self.incidents:
            if seen_at >= killed.get(record.instance_id, float("inf")):
                reports[record.instance_id].append((seen_at, record))
        return reports

    async def kill(self, members: int) -> dict[str, Any]:
        count = max(1, round(self.args.kill_fraction * members)) if self.args.kill_fraction else 0
        chosen = random.Random(self.args.seed).sample(range(members), count)
        killed: dict[str, float] = {}
        replies = await self.on_children("kill", chosen)
        for reply in replies:
            killed.update(reply["killed_at"])
        last = max(killed.values(), default=time.time())
        # Until each is reported, and past its lease's expiry: a report on that path too would
        # be a duplicate.
        deadline, at_least = last + self.args.ttl + 20, last + self.args.ttl + 3
        while time.time() < deadline:
            reports = self.lost_reports(killed)
            lost = [r for r in reports.values() if any(i.kind == "MEMBER_LOST" for _, i in r)]
            if time.time() > at_least and len(lost) == len(killed):
                break
            await asyncio.sleep(0.1)
        seen, detected, how = [], [], {"refused": 0, "grace": 0, "lease": 0, "other": 0}
        duplicates, missing = 0, []
        for name, found in self.lost_reports(killed).items():
            duplicates += len(found) > 1
            first = next(((t, i) for t, i in found if i.kind == "MEMBER_LOST"), None)
            if first is None:
                missing.append(name)
                continue
            seen.append(first[0] - killed[name])
            detected.append(first[1].detected_at - killed[name])
            path = next((p for words, p in EVIDENCE if words in first[1].evidence), "other")
            how[path] += 1

        def stats(values: list[float]) -> dict[str, float]:
            nan = float("nan")
            return {
                "p50": percentile(values, 50),
                "p99": percentile(values, 99),
                "max": max(values, default=nan),
            }

        return {
            "killed": len(killed),
            "reported": len(seen),
            "missing": missing,
            "duplicates": duplicates,
            "seen_s": stats(seen),
            "detected_s": stats(detected),
            "how": how,
            "kill_took_s": max(r["seconds"] for r in replies),
            "bound_s": self.args.ttl + 1.0,
            "killed_at": killed,
        }

    async def leave(self, rss_before: dict[str, float]) -> dict[str, Any]:
        await self.on_children("leave")
        self.phase = "retention"
        await asyncio.sleep(self.args.retention_wait)  # the retention measured, not a condition
        views = await self.health()
        out = {}
        for m in self.monitors:
            after = rss_mib(self.pids[m])
            held = sum(v.instance_id.startswith(FAKE) for v in views.get(m, []))
            out[m] = {
                "before_mib": rss_before[m],
                "after_mib": after,
                "ratio": after / rss_before[m],
                "views_held": held,
            }
        return out

    async def run(self, workdir: Path) -> dict[str, Any]:
        await asyncio.to_thread(self.stack.cli, "submit", str(EXAMPLE), "--id", JOB)
        await asyncio.to_thread(self.stack.cli, "cancel", JOB)
        _, revision = await list_prefix(self.client, self.coordinator.keys.incidents())
        follower = asyncio.create_task(self.follow_incidents(revision))
        rss_before = {m: rss_mib(self.pids[m]) for m in self.monitors}
        try:
            await self.spawn(workdir)
            levels = []
            for members in self.args.levels:
                levels.append(await self.level(members))
                print(f"  measured {members} members", flush=True)
            self.phase = "cli"
            cli = await self.time_cli()
            self.phase = "kill"
            kill = await self.kill(self.args.levels[-1])
            after_kill = await self.generator_status()
            self.phase = "leave"
            memory = await self.leave(rss_before)
            # Churn: every member joins again and leaves again. What a monitor keeps for good
            # after that (a leak) shows against its RSS after the first round.
            self.phase = "churn"
            after_first = {m: rss_mib(self.pids[m]) for m in self.monitors}
            await self.on_children("grow", list(range(self.args.levels[-1])))
            await self.until_seen(self.args.levels[-1])
            churn = await self.leave(after_first)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await asyncio.gather(*(child.stop() for child in self.children))
        killed = kill.pop("killed_at")
        false = [  # about a member never killed, or about a killed one before it was
            {"phase": phase, "instance_id": i.instance_id, "kind": i.kind, "evidence": i.evidence}
            for seen_at, phase, i in self.incidents
            if seen_at < killed.get(i.instance_id, float("inf"))
        ]
        return {
            "levels": levels,
            "cli_members": cli,
            "kill": kill,
            "memory": memory,
            "churn_memory": churn,
            "false_incidents": false,
            "generator_leases_lost": after_kill["leases_lost"],
            "generator_lag_max_s_after_window": after_kill["lag_max_s"],
        }


# ---------------------------------------------------------------- the report


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    top, kill = result["levels"][-1], result["kill"]
    p99 = {name: top["rpc"][name]["p99_ms"] for name in RPCS}
    everyone = kill["reported"] == kill["killed"]
    growth = {m: r["ratio"] for m, r in result["memory"].items()}
    churned = {m: r["ratio"] for m, r in result["churn_memory"].items()}
    return {
        "rpc_p99": {
            "ok": all(v < RPC_P99_BOUND_MS for v in p99.values()),
            "measured": p99,
            "target": f"p99 < {RPC_P99_BOUND_MS:.0f} ms at {top['members']} members",
        },
        "kill_p99": {
            "ok": everyone and kill["seen_s"]["p99"] <= kill["bound_s"],
            "measured": kill["seen_s"]["p99"],
            "target": f"every killed member reported within TTL + 1 = {kill['bound_s']:.1f} s "
            "at p99",
        },
        "no_false_incident": {
            "ok": not result["false_incidents"],
            "measured": len(result["false_incidents"]),
            "target": "no incident about a member that was not killed",
        },
        "monitor_rss": {
            "ok": all(abs(r - 1) <= RSS_GROWTH_BOUND for r in growth.values()),
            "measured": growth,
            "target": "each monitor's RSS after everyone left within 10% of before the ramp",
        },
        "steady_load": {
            "ok": result["generator_leases_lost"] == 0,
            "measured": result["generator_leases_lost"],
            "target": "the generator kept every member's lease (a lost one re-registers: the "
            "load was not the one measured)",
        },
        "monitor_rss_churn": {
            "ok": all(abs(r - 1) <= RSS_GROWTH_BOUND for r in churned.values()),
            "measured": churned,
            "target": "each monitor's RSS after a second round of every member joining and "
            "leaving within 10% of after the first",
        },
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\ncontrol plane under fake rollout members ({args.monitors} monitor(s), 2 coordinators)"
    )
    print(
        f"host: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; TTL {args.ttl} s, "
        f"beat {args.beat} s, {args.rate}/s of each read for {args.window:.0f} s, "
        f"{args.repeats} windows a level (p50/p99: their medians), "
        f"generator in {args.procs} process(es) at nice {args.generator_nice}. "
        "ms: p50/p99; CPU: % of one core"
    )
    head = (
        f"{'members':>7} | {'ListJobs':>11} | {'GetJob':>11} | {'ListMembers':>11} | "
        f"{'Health':>11} | "
        f"{'monitor CPU/RSS MiB':<24} | {'leader CPU/RSS':>14} | {'etcd CPU':>8} | "
        f"{'generator CPU':>13}"
    )
    print(head)
    print("-" * len(head))
    for row in result["levels"]:
        rpc = [f"{r['p50_ms']:.1f}/{r['p99_ms']:.1f}" for r in row["rpc"].values()]  # + Health
        monitors = " ".join(
            f"{m['cpu_pct']:.0f}%/{m['rss_mib']:.0f}" for m in row["monitors"].values()
        )
        leader = f"{row['leader']['cpu_pct']:.0f}%/{row['leader']['rss_mib']:.0f}"
        print(
            f"{row['members']:>7} | {rpc[0]:>11} | {rpc[1]:>11} | {rpc[2]:>11} | {rpc[3]:>11} | "
            f"{monitors:<24} | "
            f"{leader:>14} | {row['etcd']['cpu_pct']:>7.0f}% | "
            f"{row['generator']['cpu_pct']:>12.0f}%"
        )
    for row in result["levels"]:
        errors = sum(len(r["errors"]) for r in row["rpc"].values())
        calls = "/".join(str(r["calls"]) for r in row["rpc"].values())
        gen = row["generator"]
        print(
            f"{row['members']} members: started in {row['ramp_s']:.1f} s, {row['seen']} seen "
            f"beating after {row['seen_s']:.1f} s; calls {calls}, {errors} failed; generator "
            f"loop late by up to {gen['ramp_lag_max_s']:.2f} s in the ramp, "
            f"{gen['lag_max_s']:.2f} s in the window, {gen['leases_lost']} leases lost so far; "
            f"host load average {row['load_avg']:.1f} after the window"
        )
    cli = result["cli_members"]
    print(
        f"robustrl members at {result['levels'][-1]['members']} members: {cli['human_s']:.2f} s, "
        f"--json {cli['json_s']:.2f} s (median of {args.cli_repeat})"
    )
    kill = result["kill"]
    seen, detected, how = kill["seen_s"], kill["detected_s"], kill["how"]
    print(
        f"kill: {kill['killed']} members at once (in {kill['kill_took_s']:.2f} s), "
        f"{kill['reported']} reported lost "
        f"({len(kill['missing'])} missing, {kill['duplicates']} more than once); kill -> incident "
        f"seen p50 {seen['p50']:.2f} p99 {seen['p99']:.2f} max {seen['max']:.2f} s; "
        f"detected_at p50 {detected['p50']:.2f} p99 {detected['p99']:.2f} s; by "
        f"{how['refused']} refused, {how['grace']} grace, {how['lease']} lease, "
        f"{how['other']} other"
    )
    for name, m in result["memory"].items():
        print(
            f"memory: {name} RSS {m['before_mib']:.1f} MiB before the ramp, {m['after_mib']:.1f} "
            f"MiB {args.retention_wait:.0f} s after everyone left (x{m['ratio']:.2f}); "
            f"views of fake members still held: {m['views_held']}"
        )
    for name, m in result["churn_memory"].items():
        print(
            f"churn: {name} RSS {m['before_mib']:.1f} MiB after the first round, "
            f"{m['after_mib']:.1f} MiB after every member joined and left again "
            f"(x{m['ratio']:.2f}); views of fake members still held: {m['views_held']}"
        )
    print(
        f"generator: its members' leases lost (none refreshed within the TTL; each registered "
        f"again) by the end of the kill: {result['generator_leases_lost']}; its loop late by "
        f"up to {result['generator_lag_max_s_after_window']:.2f} s from the last window on"
    )
    grouped = collections.Counter(
        (i["phase"], i["kind"], i["evidence"][:90]) for i in result["false_incidents"]
    )
    for (phase, kind, evidence), count in grouped.most_common(8):
        print(f"false incidents: {count} x {kind} during {phase}: {evidence}")
    for name, v in result["verdicts"].items():
        measured = v["measured"]
        if isinstance(measured, dict):
            shown = ", ".join(f"{k} {x:.2f}" for k, x in measured.items())
        else:
            shown = f"{measured:.2f}" if isinstance(measured, float) else str(measured)
        print(f"verdict {name}: {v['target']}: {shown} -> {'ok' if v['ok'] else 'MISS'}")
    print(f"run took {result['seconds']:.0f} s")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="robustrl-control-plane-") as tmp:
        home = Path(tmp) / "home"
        env = {
            "ROBUSTRL_ETCD_SESSION_TTL": str(args.ttl),
            "ROBUSTRL_MONITOR_ALLOCATOR": args.monitor_allocator,
        }
        stack = Stack(home, Path(tmp) / "runs", env)
        # --monitors 1 is the one case the flag is left out (stacks before it had one monitor).
        monitors = [] if args.monitors == 1 else ["--monitors", str(args.monitors)]
        try:
            await asyncio.to_thread(stack.cli, "up", "--coordinators", "2", *monitors)
            state = StackState.load(home)
            assert state is not None, "the stack recorded nothing"
            settings = EtcdSettings(endpoints=state.etcd_endpoints, prefix=state.prefix)
            coordinator = CoordinatorClient(await connect_etcd(settings), KeySpace(state.prefix))
            try:
                result = await Bench(stack, home, args, coordinator).run(Path(tmp))
            finally:
                await coordinator.close_channels()
                await coordinator.etcd.close()
        finally:
            await asyncio.to_thread(stack.cli, "down")
    result["verdicts"] = verdicts(result)
    result["seconds"] = time.monotonic() - began
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "child")}
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="500,1000,2000", help="members at each level")
    parser.add_argument("--monitors", type=int, default=2, help="`robustrl up --monitors`")
    parser.add_argument("--procs", type=int, default=1, help="generator processes")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured a level")
    parser.add_argument(
        "--repeats", type=int, default=3, help="windows a level; p50/p99 are their medians"
    )
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before each window")
    parser.add_argument("--rate", type=float, default=5.0, help="calls a second of each read")
    parser.add_argument("--beat", type=float, default=ServiceSettings().heartbeat_interval)
    parser.add_argument("--ttl", type=int, default=EtcdSettings().session_ttl)
    parser.add_argument(
        "--monitor-allocator",
        choices=("jemalloc", "python"),
        default=MonitorSettings.model_fields["allocator"].default,
        help="ROBUSTRL_MONITOR_ALLOCATOR of the monitors (default: the monitor's own default)",
    )
    parser.add_argument(
        "--generator-nice",
        type=int,
        default=5,
        help="niceness of the generator processes: the members they stand for run on other "
        "hosts, so they take what CPU the control plane leaves (0: compete as equals)",
    )
    parser.add_argument("--kill-fraction", type=float, default=0.1)
    parser.add_argument("--retention-wait", type=float, default=70.0)
    parser.add_argument("--cli-repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="which members die")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    # A generator child (started by the run itself).
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child < 0:
        try:
            args.levels = sorted(int(n) for n in args.levels.split(","))
        except ValueError:
            parser.error("--levels: whole numbers, comma-separated")
        if not args.levels or args.levels[0] < 1 or args.procs < 1 or args.monitors < 1:
            parser.error("--levels, --procs and --monitors must be at least 1")
        if not 0 <= args.kill_fraction < 1 or args.rate <= 0 or args.cli_repeat < 1:
            parser.error("--kill-fraction in [0, 1), --rate > 0, --cli-repeat >= 1")
    return args


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    if arguments.child >= 0:
        os.nice(arguments.generator_nice)
        asyncio.run(generator_main(arguments))
        sys.exit(0)
    figures = asyncio.run(main(arguments))
    report(figures, arguments)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(figures, indent=1))
