"""`robustrl`: run the local stack and drive jobs.

Every read command takes --json. Errors are one line on stderr and a non-zero exit:
1 for a failed request, 2 for bad usage or input the CLI itself rejects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table

from robustrl.cli import chaos, provider, stack, weights
from robustrl.cli.client import DEFAULT_DEADLINE, StackClient
from robustrl.cli.formatting import age, emit_json
from robustrl.core.aio import run_process
from robustrl.core.coordinator_client import unanswered
from robustrl.v1 import coordinator_pb2, coordinator_pb2_grpc

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

DEFAULT_HOME = ".robustrl"


class UsageError(Exception):
    """Input the CLI rejects before asking the stack (exit 2)."""


# ----------------------------------------------------------------------------- helpers


def home_dir(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("ROBUSTRL_HOME") or DEFAULT_HOME).resolve()


def etcd_target(args: argparse.Namespace) -> tuple[str, str]:
    """(endpoints, prefix): --etcd, else ROBUSTRL_ETCD_ENDPOINTS, else the local stack."""
    prefix = os.environ.get("ROBUSTRL_ETCD_PREFIX", "/robustrl")
    if args.etcd:
        return args.etcd, prefix
    if os.environ.get("ROBUSTRL_ETCD_ENDPOINTS"):
        return os.environ["ROBUSTRL_ETCD_ENDPOINTS"], prefix
    state = stack.StackState.load(home_dir(args))
    if state is None or not state.procs:
        raise UsageError(
            f"no local stack running in {home_dir(args)} and no --etcd given; "
            "run `robustrl up` first"
        )
    return state.etcd_endpoints, state.prefix


def with_client(args: argparse.Namespace, fn: Callable[[StackClient], Awaitable[int]]) -> int:
    endpoints, prefix = etcd_target(args)

    async def run() -> int:
        client = await StackClient.connect(endpoints, prefix)
        try:
            return await fn(client)
        finally:
            await client.close()

    return run_process(run())


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


def ts_seconds(value: str) -> float:
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.FromJsonString(value)
    return ts.ToNanoseconds() / 1e9


def _history_retention(text: str) -> str:
    try:
        return stack.history_retention(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# ----------------------------------------------------------------------------- commands


def cmd_up(args: argparse.Namespace) -> int:
    home = home_dir(args)
    home.mkdir(parents=True, exist_ok=True)
    previous = stack.StackState.load(home)
    if previous and any(stack.is_running(p) for p in previous.procs):
        raise UsageError(f"a stack is already running from {home}; `robustrl down` first")
    state = stack.StackState(home=str(home))
    if previous:
        state.etcd_client_port = previous.etcd_client_port
        state.etcd_peer_port = previous.etcd_peer_port
    state.save()
    try:
        etcd = stack.start_etcd(state, args.etcd_history)
        wait_for_etcd(state, etcd)
        services = [stack.start_service(state, "monitor", "monitor-0")]
        for i in range(args.coordinators):
            # Replacements a coordinator starts log next to the stack's own processes.
            extra = {
                "ROBUSTRL_COORDINATOR_PROVISION_LOG_DIR": str(home / "logs"),
                "ROBUSTRL_COORDINATOR_PROVISIONER": args.provisioner,
            }
            services.append(stack.start_service(state, "coordinator", f"coordinator-{i}", extra))
        for i in range(args.trainers):
            services.append(stack.start_service(state, "trainer", f"trainer-{i}"))
        for i in range(args.standby_trainers):
            standby = {"ROBUSTRL_TRAINER_STANDBY": "true"}
            services.append(stack.start_service(state, "trainer", f"standby-{i}", standby))
        for i in range(args.rollouts):
            services.append(stack.start_service(state, "rollout", f"rollout-{i}"))
        wait_for_members(state, services, timeout=args.timeout)
    except (stack.StackError, KeyboardInterrupt):
        stack.stop_procs(state.procs)
        raise
    console.print(f"[green]stack up[/green]: etcd at {state.etcd_endpoints}, state in {home}")
    rc = with_client(args, lambda c: print_members(c, as_json=False))
    if args.job:
        rc = cmd_submit(
            argparse.Namespace(**{**vars(args), "file": args.job, "overrides": [], "id": ""})
        )
    return rc


def wait_for_etcd(state: stack.StackState, etcd: stack.Proc) -> None:
    stack.wait_until(
        lambda: stack.etcd_healthy(state.etcd_endpoints), 30, "waiting for etcd to answer", [etcd]
    )


def wait_for_members(state: stack.StackState, procs: list[stack.Proc], timeout: float) -> None:
    """Every started service registered in etcd and answering its health check."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    wanted = {p.name for p in procs}

    async def all_healthy() -> bool:
        client = await StackClient.connect(state.etcd_endpoints, state.prefix)
        try:
            members = {m.instance_id: m for m in await client.members()}
            if not wanted <= members.keys():
                return False
            for name in wanted:
                channel = grpc.aio.insecure_channel(members[name].address)
                async with channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            await client.close()

    stack.wait_until(lambda: asyncio.run(all_healthy()), timeout, "waiting for services", procs)


def cmd_down(args: argparse.Namespace) -> int:
    home = home_dir(args)
    state = stack.StackState.load(home)
    if state is None:
        console.print(f"no stack recorded in {home}; nothing to stop")
        return 0
    stopped = stack.stop_stack(state)
    if args.purge:
        shutil.rmtree(home / "etcd", ignore_errors=True)
        (home / stack.STATE_FILE).unlink(missing_ok=True)
    else:
        # Keep the ports so the next `up` reuses etcd's data: jobs survive down/up.
        state.procs = []
        state.save()
    console.print(f"stopped {len(stopped)} process(es): {', '.join(stopped) or '-'}")
    return 0


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


def cmd_jobs(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        reply = await client.read(
            lambda s: s.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=DEFAULT_DEADLINE)
        )
        jobs = [job_dict(j) for j in reply.jobs]
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
    async def run(client: StackClient) -> int:
        if args.job:
            request = coordinator_pb2.GetJobRequest(job_id=args.job)
            job = job_dict(await client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE)))
            bound = [m.model_dump() for m in await client.members() if m.job_id == args.job]
            job["bound_members"] = bound
            job["work"] = await client.work_summary(args.job)
            job["recoveries"] = await client.recoveries(args.job)
            job["ettr"] = await client.ettr(args.job)
            endpoints = etcd_target(args)[0]
            job["etcd_alarms"] = await asyncio.to_thread(stack.etcd_alarms, endpoints)
            if args.json:
                emit_json(job)
                return 0
            console.print(f"[bold]{job['job_id']}[/bold]  {job['phase']}  {job['message']}")
            console.print(f"  step {job['step']}  weight version {job['weight_version']}")
            for key, value in sorted(job["metrics"].items()):
                console.print(f"  {key}: {value:.4g}")
            if job["work"]:
                console.print("  groups: " + ", ".join(f"{k} {v}" for k, v in job["work"].items()))
            for m in bound:
                console.print(f"  member {m['role']} {m['instance_id']} ({m['address']})")
            if job["ettr"]:
                console.print("  " + ettr_line(job["ettr"]))
            for r in job["recoveries"]:
                took = f"recovered in {r['recovery_s']:.1f}s" if r["done_at"] else "recovering"
                console.print(
                    f"  incident {r['kind']} {r['instance_id']}: {', '.join(r['actions'])}; "
                    f"{took}" + (f" ({', '.join(r['replacements'])})" if r["replacements"] else "")
                )
            warn_about_etcd(endpoints, job["etcd_alarms"])
            return 0
        leader = await client.leader()
        members = await client.members()
        reply = await client.read(
            lambda s: s.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=DEFAULT_DEADLINE)
        )
        jobs = [job_dict(j) for j in reply.jobs]
        summary = {
            "leader": leader["instance_id"] if leader else None,
            "members": [m.model_dump() for m in members],
            "jobs": jobs,
        }
        if args.json:
            emit_json(summary)
            return 0
        roles: dict[str, int] = {}
        for member in members:
            roles[member.role] = roles.get(member.role, 0) + 1
        console.print(f"leader: {summary['leader'] or '(none)'}")
        console.print("members: " + ", ".join(f"{n} {r}" for r, n in roles.items()))
        phases: dict[str, int] = {}
        for j in jobs:
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


async def print_members(client: StackClient, as_json: bool) -> int:
    members = await client.members()
    leader = await client.leader()
    leader_id = leader["instance_id"] if leader else ""
    rows = [{**m.model_dump(), "leader": m.instance_id == leader_id} for m in members]
    if as_json:
        emit_json(rows)
        return 0
    table = Table("ROLE", "INSTANCE", "ADDRESS", "PID", "EPOCH", "JOB", "", box=None)
    for row in rows:
        table.add_row(
            row["role"],
            row["instance_id"],
            row["address"],
            str(row["pid"]),
            str(row["epoch"]),
            row["job_id"] or "-",
            "leader" if row["leader"] else "",
        )
    console.print(table if rows else "no members registered")
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    return with_client(args, lambda c: print_members(c, args.json))


def cmd_incidents(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        records = await client.incidents(args.job or "")
        if args.json:
            emit_json(records)
            return 0
        table = Table("WHEN", "KIND", "ROLE", "INSTANCE", "RANK", "JOB", "EVIDENCE", box=None)
        for r in records:
            table.add_row(
                age(r["detected_at"]),
                r["kind"],
                r["role"],
                r["instance_id"],
                str(r.get("rank", 0)),
                r["job_id"] or "-",
                r["evidence"],
            )
        console.print(table if records else "no incidents")
        return 0

    return with_client(args, run)


def cmd_dropped(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        request = coordinator_pb2.GetJobRequest(job_id=args.job)
        await client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE))  # known job?
        dropped = await client.dropped_groups(args.job) or {}
        if args.json:
            emit_json(dropped)
            return 0
        table = Table("GROUP", "WHY", box=None)
        for group, why in sorted(dropped.items()):
            table.add_row(group, why)
        console.print(table if dropped else f"job {args.job} dropped no group")
        return 0

    return with_client(args, run)


DEFAULT_MODEL = ".robustrl/models/tiny-qwen"


def cmd_weights(args: argparse.Namespace) -> int:
    """A job's weight versions and holders, and its members' pulls (robustrl/cli/weights.py)."""
    return with_client(args, lambda c: weights.run(c, args, console))


def cmd_model_init(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        console.print(f"model already at {out} (use --force to make it again)")
        return 0
    # torch is imported only here: the rest of the CLI stays free of the model stack.
    from robustrl.generation import modelgen

    argv = ["--out", str(out), "--seed", str(args.seed)]
    if args.sft_steps is not None:
        argv += ["--sft-steps", str(args.sft_steps)]
    return modelgen.main(argv)


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


def cmd_provider(args: argparse.Namespace) -> int:
    """Fulfil an `external` provisioner's requests with a command (robustrl/cli/provider.py)."""
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    unknown = sorted(set(roles) - {"trainer", "rollout"})
    if unknown or not roles:
        given = ",".join(unknown) or "nothing"
        raise UsageError(f"--roles takes trainer and/or rollout, not {given}")
    name = args.name or f"provider-{os.uname().nodename}-{os.getpid()}"

    async def run(client: StackClient) -> int:
        console.print(f"provider {name}: serving {', '.join(roles)} requests with: {args.exec}")
        try:
            await provider.serve_requests(
                client, args.exec, name=name, roles=roles, timeout=args.timeout
            )
        except provider.ProviderError as exc:
            raise UsageError(f"the coordinator refused this provider: {exc}") from exc
        return 0

    try:
        return with_client(args, run)
    except KeyboardInterrupt:
        return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="robustrl", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--home", help=f"local stack state directory (default {DEFAULT_HOME}, env ROBUSTRL_HOME)"
    )
    parser.add_argument("--etcd", help="etcd endpoints host:port[,...] (default: the local stack)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start the local stack: etcd + services as local processes")
    up.add_argument("--coordinators", type=int, default=2, help="coordinator replicas (default 2)")
    up.add_argument("--trainers", type=int, default=0, help="trainer instances (default 0)")
    up.add_argument("--rollouts", type=int, default=0, help="rollout instances (default 0)")
    up.add_argument(
        "--standby-trainers",
        type=int,
        default=0,
        help="warm standby trainers, promoted when a job's trainer fails (default 0)",
    )
    up.add_argument(
        "--provisioner",
        choices=("local", "external", "none"),
        default="local",
        help="who starts replacement members: local processes (default), a scheduler "
        "connected with `robustrl provider` (external), or nobody (none)",
    )
    up.add_argument(
        "--etcd-history",
        type=_history_retention,
        default=stack.ETCD_HISTORY_RETENTION,
        metavar="DURATION",
        help="how much history etcd keeps before compacting it, e.g. 30s, 5m, 1h "
        f"(default {stack.ETCD_HISTORY_RETENTION})",
    )
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for health")
    up.add_argument("--job", help="submit this job spec once the stack is up")
    up.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop exactly what `up` started")
    down.add_argument("--purge", action="store_true", help="also delete etcd's data (all jobs)")
    down.set_defaults(func=cmd_down)

    submit = sub.add_parser("submit", help="submit a job spec (YAML) with key.sub=value overrides")
    submit.add_argument("file", help="the job spec's YAML file, or - to read it from stdin")
    submit.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    submit.add_argument("--id", help="job id (default: the spec's id, else <name>-<suffix>)")
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=cmd_submit)

    jobs = sub.add_parser("jobs", help="list jobs")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=cmd_jobs)

    status = sub.add_parser("status", help="the stack's status, or one job's")
    status.add_argument("job", nargs="?")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    dropped = sub.add_parser("dropped", help="every prompt group a job dropped, and why")
    dropped.add_argument("job")
    dropped.add_argument("--json", action="store_true")
    dropped.set_defaults(func=cmd_dropped)

    weights_cmd = sub.add_parser(
        "weights", help="a job's weight versions, their holders, and its members' pulls"
    )
    weights_cmd.add_argument("job")
    weights_cmd.add_argument("--json", action="store_true")
    weights_cmd.set_defaults(func=cmd_weights)

    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job")
    cancel.add_argument("--reason", default="")
    cancel.set_defaults(func=cmd_cancel)

    delete = sub.add_parser("delete", help="remove an ended job's state from etcd")
    delete.add_argument("job")
    delete.set_defaults(func=cmd_delete)
    members = sub.add_parser("members", help="registered members; marks the leader coordinator")
    members.add_argument("--json", action="store_true")
    members.set_defaults(func=cmd_members)

    model = sub.add_parser("model", help="the local tiny model")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = model_sub.add_parser("init", help="write a tiny Qwen-family model (+ SFT warm-up)")
    init.add_argument("--out", default=DEFAULT_MODEL, help=f"directory (default {DEFAULT_MODEL})")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--sft-steps", type=int, default=None, help="0 skips the warm-up")
    init.add_argument("--force", action="store_true", help="overwrite an existing model")
    init.set_defaults(func=cmd_model_init)

    watch = sub.add_parser("watch", help="follow a job until it ends (exit 0 if it succeeded)")
    watch.add_argument("job")
    watch.add_argument("--json", action="store_true", help="one JSON line per change")
    watch.add_argument(
        "--patience",
        type=float,
        default=WATCH_PATIENCE_S,
        help=f"seconds to wait for a coordinator to answer again (default {WATCH_PATIENCE_S:.0f})",
    )
    watch.set_defaults(func=cmd_watch)

    incidents = sub.add_parser("incidents", help="incidents the monitor recorded")
    incidents.add_argument("job", nargs="?")
    incidents.add_argument("--json", action="store_true")
    incidents.set_defaults(func=cmd_incidents)

    chaos_cmd = sub.add_parser("chaos", help="inject failures into a running job: kill, hang, NaN")
    chaos.add_arguments(chaos_cmd)
    chaos_cmd.set_defaults(func=cmd_chaos)

    provide = sub.add_parser(
        "provider",
        help="start replacement members for an `external` provisioner by running a command",
    )
    provide.add_argument(
        "--exec",
        required=True,
        metavar="CMD",
        help="shell command run per request, with the request in ROBUSTRL_PROVISION_* and the "
        "member's environment (see robustrl/cli/provider.py); exit 0 means started",
    )
    provide.add_argument("--name", default="", help="this scheduler's name (default: host-pid)")
    provide.add_argument(
        "--roles", default="trainer,rollout", help="roles it starts (default trainer,rollout)"
    )
    provide.add_argument(
        "--timeout", type=float, default=120.0, help="seconds CMD may run (default 120)"
    )
    provide.set_defaults(func=cmd_provider)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`submit job.yaml --id x trainer.lr=1e-5`),
    # which one positional list cannot express in argparse: collect the leftovers here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "submit" or not all("=" in e and not e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader gone early fails here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader stopped reading (`robustrl status JOB --json | head`): end quietly, as
        # other command-line tools do on SIGPIPE, with nothing more written to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except UsageError as exc:
        err_console.print(f"robustrl: error: {exc}", highlight=False)
        return 2
    except grpc.aio.AioRpcError as exc:
        err_console.print(f"robustrl: error: {exc.code().name}: {exc.details()}", highlight=False)
        return 1
    except stack.StackError as exc:
        err_console.print(f"robustrl: error: {exc}", highlight=False)
        return 1
    except Exception as exc:
        from robustrl.contracts.errors import RobustrlError

        if isinstance(exc, RobustrlError):  # e.g. etcd unreachable
            err_console.print(f"robustrl: error: {exc.message}", highlight=False)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
