"""The commands that run the local stack: up (etcd and the services as local processes), down
(exactly what up started, and the replacements its coordinators provisioned), and provider
(replacement members for an `external` provisioner, started by a command)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil

import grpc

from robustrl.cli import provider, stack
from robustrl.cli.client import StackClient
from robustrl.cli.context import UsageError, home_dir, with_client
from robustrl.cli.formatting import console
from robustrl.cli.inspect_commands import print_members
from robustrl.cli.job_commands import cmd_submit
from robustrl.core.processes import may_raise_priority


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
    nice = standby_nice(args.standby_nice)
    members = args.trainers + args.standby_trainers + args.rollouts + args.standby_rollouts
    try:
        etcd = stack.start_etcd(state, args.etcd_history)
        # Importing torch takes the template 5-10 s of a core: it does so while etcd, the
        # monitors and the coordinators start (decision 0023).
        wanted = bool(members and args.template)
        shared = wanted and bool(args.template_socket)
        if shared:
            state.template_socket, state.template_shared = args.template_socket, True
        template = stack.start_template(state) if wanted and not shared else None
        wait_for_etcd(state, etcd)
        services = [
            stack.start_service(state, "monitor", f"monitor-{i}") for i in range(args.monitors)
        ]
        for i in range(args.coordinators):
            # Replacements a coordinator starts log next to the stack's own processes.
            extra = {
                "ROBUSTRL_COORDINATOR_PROVISION_LOG_DIR": str(home / "logs"),
                "ROBUSTRL_COORDINATOR_PROVISIONER": args.provisioner,
                "ROBUSTRL_COORDINATOR_PROVISION_TEMPLATE_SOCKET": state.template_socket,
                **({} if args.template else {"ROBUSTRL_COORDINATOR_PROVISION_TEMPLATE": "false"}),
                **nice,  # the local provisioner's members inherit it (only standbys use it)
            }
            services.append(stack.start_service(state, "coordinator", f"coordinator-{i}", extra))
        fork = template is not None and stack.template_ready(state, template, args.timeout)
        if template is not None and not fork:
            console.print(
                f"[yellow]warning[/yellow]: the warm template is not serving; members start "
                f"fresh. Its log ends:\n{stack.log_tail(template)}"
            )
        if shared:
            fork = os.path.exists(state.template_socket)
            if not fork:
                console.print(
                    f"[yellow]warning[/yellow]: no template serves at {state.template_socket}; "
                    "members start fresh"
                )
        for i in range(args.trainers):
            services.append(stack.start_service(state, "trainer", f"trainer-{i}", fork=fork))
        for i in range(args.standby_trainers):
            standby = {"ROBUSTRL_TRAINER_STANDBY": "true", **nice}
            services.append(
                stack.start_service(state, "trainer", f"standby-{i}", standby, fork=fork)
            )
        for i in range(args.rollouts):
            services.append(stack.start_service(state, "rollout", f"rollout-{i}", fork=fork))
        for i in range(args.standby_rollouts):
            standby = {"ROBUSTRL_ROLLOUT_STANDBY": "true", **nice}
            services.append(
                stack.start_service(state, "rollout", f"standby-rollout-{i}", standby, fork=fork)
            )
        wait_for_members(state, services, timeout=args.timeout)
    except (stack.StackError, KeyboardInterrupt):
        stack.stop_procs(state.procs)
        stack.remove_template(state)
        raise
    console.print(f"[green]stack up[/green]: etcd at {state.etcd_endpoints}, state in {home}")
    rc = with_client(args, lambda c: print_members(c, as_json=False))
    if args.job:
        rc = cmd_submit(
            argparse.Namespace(**{**vars(args), "file": args.job, "overrides": [], "id": ""})
        )
    return rc


DEFAULT_STANDBY_NICE = 10


def standby_nice(asked: int | None) -> dict[str, str]:
    """The environment that makes this stack's standbys run `asked` nicer until bound (None:
    DEFAULT_STANDBY_NICE where they may go back, else 0). UsageError if asked for where they
    may not: each standby would refuse to start."""
    may = may_raise_priority(os.nice(0))
    if asked is None:
        asked = DEFAULT_STANDBY_NICE if may else 0
    elif asked and not may:
        raise UsageError(
            f"--standby-nice {asked}: standbys started here could not raise their priority "
            "back when bound (no CAP_SYS_NICE, RLIMIT_NICE too low); use --standby-nice 0"
        )
    return {f"ROBUSTRL_{role}_STANDBY_NICE": str(asked) for role in ("TRAINER", "ROLLOUT")}


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
