"""The commands that drive jobs: submit, jobs, status, watch, cancel, delete, and chaos (a
failure injected into a running job). `status` and `watch` also say when etcd raised an alarm
that stops every job."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.table import Table

from robustrl.cli import chaos, stack
from robustrl.cli.client import DEFAULT_DEADLINE, StackClient
from robustrl.cli.context import UsageError, etcd_target, with_client
from robustrl.cli.formatting import age, console, emit_json, err_console
from robustrl.core.coordinator_client import unanswered
from robustrl.v1 import coordinator_pb2, coordinator_pb2_grpc


def job_dict(job: coordinator_pb2.Job) -> dict[str, Any]:
    out = MessageToDict(
        job, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out["phase"] = out["phase"].removeprefix("JOB_PHASE_")
    out["spec"] = json.loads(out.pop("spec_json") or "{}")
    for key in ("revision", "step", "weight_version"):
        out[key] = int(out[key])
    return out


def ettr_line(summary: dict[str, Any]) -> str:
    line = (
        f"ETTR {100 * summary['ettr']:.1f}% (kept progress {summary['effective_s']:.0f}s of "
        f"{summary['wall_s']:.0f}s wall"
    )
    if summary["rolled_back_steps"]:
        line += f"; {summary['rolled_back_steps']} steps rolled back"
    if summary.get("stalled_s", 0.0) >= 1.0:
        line += f"; {summary['stalled_s']:.0f}s of trainer stalls not counted"
    return line + ")"


def goodput(job: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The job's goodput against `reference`, the same job run without faults on the same
    stack: its wall time over this job's (from each job's ETTR account). While the job runs,
    the reference's wall time for the steps made so far, pro rata. UsageError where the two
    cannot be compared."""
    name = reference["job_id"]
    if reference["phase"] != "SUCCEEDED":
        raise UsageError(
            f"--against {name}: that job is {reference['phase']}; goodput compares against a "
            "fault-free run that succeeded"
        )
    steps, ref_steps = job["spec"].get("trainer", {}), reference["spec"].get("trainer", {})
    if steps.get("steps") != ref_steps.get("steps"):
        raise UsageError(
            f"--against {name}: it trains {ref_steps.get('steps', 'the default')} steps and "
            f"{job['job_id']} {steps.get('steps', 'the default')}: not the same job"
        )
    if not job["ettr"] or not reference["ettr"]:
        missing = job["job_id"] if not job["ettr"] else name
        raise UsageError(f"--against {name}: {missing} has no time account (it never ran)")
    wall, ref_wall = job["ettr"]["wall_s"], reference["ettr"]["wall_s"]
    so_far = job["phase"] != "SUCCEEDED"
    if so_far:
        ref_wall *= job["step"] / max(reference["step"], 1)
    return {
        "against": name,
        "goodput": ref_wall / wall if wall > 0 else 0.0,
        "reference_wall_s": ref_wall,
        "wall_s": wall,
        "so_far": so_far,
    }


def ts_seconds(value: str) -> float:
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.FromJsonString(value)
    return ts.ToNanoseconds() / 1e9


def progress_line(job: dict[str, Any]) -> str:
    metrics = job["metrics"]
    steps = job["spec"].get("trainer", {}).get("steps", "?")
    parts = [
        f"{job['job_id']} {job['phase']:<10}",
        f"step {job['step']}/{steps}",
        f"v{job['weight_version']}",
    ]
    for key, label, fmt in [
        ("reward", "reward", ".3f"),
        ("eval_reward", "eval", ".3f"),
        ("tokens_per_s", "tok/s", ".0f"),
    ]:
        if key in metrics:
            parts.append(f"{label} {format(metrics[key], fmt)}")
    return "  ".join(parts)


def read_spec_file(path: str) -> str:
    """The spec at path, or on standard input for `-` (a spec piped into a container's CLI)."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read job spec {path}: {exc.strerror}") from exc


def cmd_submit(args: argparse.Namespace) -> int:
    request = coordinator_pb2.SubmitJobRequest(
        spec=read_spec_file(args.file), overrides=args.overrides, job_id=args.id or ""
    )

    async def run(client: StackClient) -> int:
        job = await client.write(lambda s: s.SubmitJob(request, timeout=DEFAULT_DEADLINE))
        if args.json:
            emit_json(job_dict(job))
        else:
            console.print(f"submitted job [bold]{job.job_id}[/bold]")
        return 0

    return with_client(args, run)


async def job_list(client: StackClient) -> list[dict[str, Any]]:
    """Every job, as `jobs --json` prints it."""
    reply = await client.read(
        lambda s: s.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=DEFAULT_DEADLINE)
    )
    return [job_dict(j) for j in reply.jobs]


async def read_job(client: StackClient, job_id: str) -> dict[str, Any]:
    request = coordinator_pb2.GetJobRequest(job_id=job_id)
    return job_dict(await client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE)))


async def job_status(
    client: StackClient, job_id: str, endpoints: str, against: str | None = None
) -> dict[str, Any]:
    """One job as `status JOB --json` prints it: the job, its bound members, work ledger
    counts, recoveries, ETTR, etcd's alarms, and its goodput `against` a reference job."""
    job = await read_job(client, job_id)
    job["bound_members"] = [m.model_dump() for m in await client.members() if m.job_id == job_id]
    job["work"] = await client.work_summary(job_id)
    job["recoveries"] = await client.recoveries(job_id)
    job["ettr"] = await client.ettr(job_id)
    if against:
        ref = await read_job(client, against)
        ref["ettr"] = await client.ettr(against)
        job["goodput"] = goodput(job, ref)
    job["etcd_alarms"] = await asyncio.to_thread(stack.etcd_alarms, endpoints)
    return job


async def stack_summary(client: StackClient) -> dict[str, Any]:
    """The stack as `status --json` prints it: the leader, every member and every job."""
    leader = await client.leader()
    return {
        "leader": leader["instance_id"] if leader else None,
        "members": [m.model_dump() for m in await client.members()],
        "jobs": await job_list(client),
    }


def cmd_jobs(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        jobs = await job_list(client)
        if args.json:
            emit_json(jobs)
            return 0
        table = Table("JOB", "PHASE", "STEP", "VERSION", "AGE", "MESSAGE", box=None)
        for job in jobs:
            table.add_row(
                job["job_id"],
                job["phase"],
                str(job["step"]),
                str(job["weight_version"]),
                age(ts_seconds(job["created_at"])),
                job["message"],
            )
        console.print(table if jobs else "no jobs")
        return 0

    return with_client(args, run)


def cmd_status(args: argparse.Namespace) -> int:
    if args.against and not args.job:
        raise UsageError("--against compares one job with another: name the job")

    async def run(client: StackClient) -> int:
        if args.job:
            endpoints = etcd_target(args)[0]
            job = await job_status(client, args.job, endpoints, args.against)
            if args.json:
                emit_json(job)
                return 0
            console.print(f"[bold]{job['job_id']}[/bold]  {job['phase']}  {job['message']}")
            console.print(f"  step {job['step']}  weight version {job['weight_version']}")
            for key, value in sorted(job["metrics"].items()):
                console.print(f"  {key}: {value:.4g}")
            if job["work"]:
                console.print("  groups: " + ", ".join(f"{k} {v}" for k, v in job["work"].items()))
            for m in job["bound_members"]:
                console.print(f"  member {m['role']} {m['instance_id']} ({m['address']})")
            if job["ettr"]:
                console.print("  " + ettr_line(job["ettr"]))
            if args.against:
                g = job["goodput"]
                console.print(
                    f"  goodput {g['goodput']:.2f}{' so far' if g['so_far'] else ''} against "
                    f"{g['against']} ({g['reference_wall_s']:.0f}s wall without faults"
                    f"{', pro rata' if g['so_far'] else ''}, {g['wall_s']:.0f}s here)"
                )
            for r in job["recoveries"]:
                took = f"recovered in {r['recovery_s']:.1f}s" if r["done_at"] else "recovering"
                console.print(
                    f"  incident {r['kind']} {r['instance_id']}: {', '.join(r['actions'])}; "
                    f"{took}" + (f" ({', '.join(r['replacements'])})" if r["replacements"] else "")
                )
            warn_about_etcd(endpoints, job["etcd_alarms"])
            return 0
        summary = await stack_summary(client)
        if args.json:
            emit_json(summary)
            return 0
        roles: dict[str, int] = {}
        for member in summary["members"]:
            roles[member["role"]] = roles.get(member["role"], 0) + 1
        console.print(f"leader: {summary['leader'] or '(none)'}")
        console.print("members: " + ", ".join(f"{n} {r}" for r, n in roles.items()))
        phases: dict[str, int] = {}
        for j in summary["jobs"]:
            phases[j["phase"]] = phases.get(j["phase"], 0) + 1
        console.print("jobs: " + (", ".join(f"{n} {p}" for p, n in phases.items()) or "none"))
        return 0

    return with_client(args, run)


def cmd_cancel(args: argparse.Namespace) -> int:
    request = coordinator_pb2.CancelJobRequest(job_id=args.job, reason=args.reason)

    async def run(client: StackClient) -> int:
        job = await client.write(lambda s: s.CancelJob(request, timeout=DEFAULT_DEADLINE))
        console.print(f"job [bold]{job.job_id}[/bold] cancelled")
        return 0

    return with_client(args, run)


def cmd_update(args: argparse.Namespace) -> int:
    request = coordinator_pb2.UpdateJobRequest(job_id=args.job, overrides=args.overrides)

    async def run(client: StackClient) -> int:
        job = await client.write(lambda s: s.UpdateJob(request, timeout=DEFAULT_DEADLINE))
        if args.json:
            emit_json(job_dict(job))
        else:
            steps = json.loads(job.spec_json).get("trainer", {}).get("steps", "?")
            console.print(f"job [bold]{job.job_id}[/bold] updated: step {job.step}/{steps}")
        return 0

    return with_client(args, run)


def cmd_delete(args: argparse.Namespace) -> int:
    request = coordinator_pb2.DeleteJobRequest(job_id=args.job)

    async def run(client: StackClient) -> int:
        reply = await client.write(lambda s: s.DeleteJob(request, timeout=DEFAULT_DEADLINE))
        console.print(
            f"job [bold]{reply.job_id}[/bold] deleted ({reply.keys_deleted} etcd keys); its "
            "run directory on the trainer hosts is kept"
        )
        return 0

    return with_client(args, run)


WATCH_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Statuses `watch` waits out: the replica it watched went away (a failover)."""

WATCH_PATIENCE_S = 60.0
"""How long `watch` waits for a coordinator to answer again before it gives up: longer than a
failover or an etcd outage that the stack rides out."""


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow a job until it ends, one live line; exit 0 only if it succeeded. A coordinator
    that goes away (a failover), or none registered (their registrations lapse in an etcd
    outage), is waited out for up to --patience seconds since the last answer."""
    request = coordinator_pb2.WatchJobRequest(job_id=args.job)

    async def run(client: StackClient) -> int:
        warnings = asyncio.create_task(keep_warning_about_etcd(etcd_target(args)[0]))
        try:
            return await follow(client)
        finally:
            warnings.cancel()

    async def follow(client: StackClient) -> int:
        started = answered = time.monotonic()
        last: dict[str, Any] | None = None
        while True:
            try:
                address = (await client.addresses())[0]
                async with grpc.aio.insecure_channel(address) as channel:
                    stream = coordinator_pb2_grpc.CoordinatorStub(channel).WatchJob(request)
                    async for event in stream:
                        answered = time.monotonic()
                        last = job_dict(event.job)
                        if args.json:
                            print(json.dumps(last, sort_keys=True), flush=True)
                        else:
                            console.print(
                                progress_line(last), end="\r" if console.is_terminal else "\n"
                            )
                        if last["phase"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                            break
            except Exception as exc:
                if (
                    not unanswered(exc, WATCH_RETRIED)
                    or time.monotonic() - answered > args.patience
                ):
                    raise
                await asyncio.sleep(0.3)
                continue
            break
        assert last is not None
        if not args.json:
            console.print()
            took = time.monotonic() - started
            console.print(f"{last['job_id']} {last['phase']} after {took:.0f}s: {last['message']}")
        return 0 if last["phase"] == "SUCCEEDED" else 1

    return with_client(args, run)


ETCD_CHECK_INTERVAL = 10.0
"""Seconds between `watch`'s checks of etcd's alarms (a job stalls silently under NOSPACE)."""


def warn_about_etcd(endpoints: str, alarms: list[str] | None = None) -> None:
    """Print why etcd refuses writes, if it raised an alarm (`alarms`: as already read)."""
    warning = stack.alarm_warning(endpoints, alarms)
    if warning:
        err_console.print(f"[bold red]warning:[/bold red] {warning}")


async def keep_warning_about_etcd(endpoints: str) -> None:
    """While a job is watched: warn once each time etcd goes into an alarm."""
    said: str | None = None
    while True:
        warning = await asyncio.to_thread(stack.alarm_warning, endpoints)
        if warning and warning != said:
            err_console.print(f"\n[bold red]warning:[/bold red] {warning}")
        said = warning
        await asyncio.sleep(ETCD_CHECK_INTERVAL)


def cmd_chaos(args: argparse.Namespace) -> int:
    """Inject failures into a running job (robustrl/cli/chaos.py)."""
    try:
        return with_client(args, lambda c: chaos.run(c, args))
    except chaos.ChaosError as exc:
        raise UsageError(str(exc)) from exc
