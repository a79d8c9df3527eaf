"""`robustrl`: run the local stack and drive jobs.

Every read command takes --json. Errors are one line on stderr and a non-zero exit:
1 for a failed request, 2 for bad usage or input the CLI itself rejects.

This module is the argument parser and the dispatch to the commands, grouped by what they
do: `stack_commands` (up, down, provider), `job_commands` (submit, jobs, status, watch,
cancel, update, delete, chaos) and `inspect_commands` (members, incidents, dropped, weights). `model
init` is here: it alone imports the model stack (torch), and the import contract that keeps
torch out of the CLI (pyproject.toml) names this module as its one exception.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from robustrl.cli import chaos, stack
from robustrl.cli.context import DEFAULT_HOME, UsageError
from robustrl.cli.formatting import console, err_console
from robustrl.cli.inspect_commands import cmd_dropped, cmd_incidents, cmd_members, cmd_weights
from robustrl.cli.job_commands import (
    WATCH_PATIENCE_S,
    cmd_cancel,
    cmd_chaos,
    cmd_delete,
    cmd_jobs,
    cmd_status,
    cmd_submit,
    cmd_update,
    cmd_watch,
)
from robustrl.cli.stack_commands import cmd_down, cmd_provider, cmd_up
from robustrl.core.template import PRELOAD

DEFAULT_MODEL = ".robustrl/models/tiny-qwen"
LIKE_NAMES = ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b")
"""`model init --like` (generation/real_shapes.py's LIKE, named here: the CLI imports no torch
to parse its arguments)."""


def cmd_model_init(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        console.print(f"model already at {out} (use --force to make it again)")
        return 0
    # torch is imported only here: the rest of the CLI stays free of the model stack.
    if args.like:
        from robustrl.generation.real_shapes import write_like

        try:
            write_like(args.like, out, seed=args.seed, layers=args.layers)
        except ValueError as exc:
            err_console.print(f"robustrl: error: {exc}")
            return 2
        console.print(f"model like {args.like} written to {out}")
        return 0
    if args.layers is not None:
        err_console.print("robustrl: error: --layers goes with --like")
        return 2
    from robustrl.generation import modelgen

    argv = ["--out", str(out), "--seed", str(args.seed)]
    if args.sft_steps is not None:
        argv += ["--sft-steps", str(args.sft_steps)]
    return modelgen.main(argv)


def _whole_number(low: int, high: int | None, why: str) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high` (None: no upper bound), else the
    error `why`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(why)
        return value

    return parse


_monitors = _whole_number(1, None, "at least 1: nothing detects failures without a monitor")
_niceness = _whole_number(0, 19, "from 0 (standbys compete as equals) to 19")


def _history_retention(text: str) -> str:
    try:
        return stack.history_retention(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="robustrl", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--home", help=f"local stack state directory (default {DEFAULT_HOME}, env ROBUSTRL_HOME)"
    )
    parser.add_argument("--etcd", help="etcd endpoints host:port[,...] (default: the local stack)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start the local stack: etcd + services as local processes")
    up.add_argument("--coordinators", type=int, default=2, help="coordinator replicas (default 2)")
    up.add_argument(
        "--monitors",
        type=_monitors,
        default=1,
        help="monitor replicas; the members' beats split between them (default 1)",
    )
    up.add_argument("--trainers", type=int, default=0, help="trainer instances (default 0)")
    up.add_argument("--rollouts", type=int, default=0, help="rollout instances (default 0)")
    up.add_argument(
        "--standby-trainers",
        type=int,
        default=0,
        help="warm standby trainers, promoted when a job's trainer fails (default 0)",
    )
    up.add_argument(
        "--standby-rollouts",
        type=int,
        default=0,
        help="warm standby rollouts: each keeps a running job's engine and weights ready and "
        "replaces a rollout the job loses (default 0)",
    )
    up.add_argument(
        "--standby-nice",
        type=_niceness,
        default=None,
        help="how much nicer standbys run until bound, those started here and the refills "
        "the coordinators start (default 10 where the standbys may go back when bound, "
        "else 0; see MemberSettings.standby_nice)",
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
    up.add_argument(
        "--no-template",
        dest="template",
        action="store_false",
        help="start every trainer and rollout as a fresh interpreter, those started here and "
        "the coordinators' replacements, instead of forking them from a warm template",
    )
    up.add_argument(
        "--template-socket",
        default=os.environ.get("ROBUSTRL_TEMPLATE_SOCKET", ""),
        metavar="PATH",
        help="fork the trainers and rollouts, and the coordinators' replacements, from the warm "
        "template already serving at PATH (`python -m robustrl.core.template --stay PATH "
        f"{' '.join(PRELOAD)}`, or another stack's) instead of starting one; `down` leaves it "
        "running (default: $ROBUSTRL_TEMPLATE_SOCKET)",
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
    status.add_argument(
        "--against",
        metavar="REF",
        help="also show the job's goodput: the wall time of REF, the same job run without "
        "faults on the same stack, over this job's",
    )
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

    update = sub.add_parser(
        "update", help="change a running job's step budget: update JOB trainer.steps=N"
    )
    update.add_argument("job")
    update.add_argument("overrides", nargs="+", metavar="KEY=VALUE")
    update.add_argument("--json", action="store_true")
    update.set_defaults(func=cmd_update)

    delete = sub.add_parser("delete", help="remove an ended job's state from etcd")
    delete.add_argument("job")
    delete.set_defaults(func=cmd_delete)
    members = sub.add_parser("members", help="registered members; marks the leader coordinator")
    members.add_argument("--json", action="store_true")
    members.set_defaults(func=cmd_members)

    model = sub.add_parser("model", help="the local tiny model")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = model_sub.add_parser(
        "init",
        help="write the tiny Qwen-family model (+ SFT warm-up), or one shaped like a release",
    )
    init.add_argument("--out", default=DEFAULT_MODEL, help=f"directory (default {DEFAULT_MODEL})")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--like",
        choices=LIKE_NAMES,
        help="a release's architecture, config and vocabulary, random weights, bf16",
    )
    init.add_argument(
        "--layers",
        type=_whole_number(1, None, "--layers: at least 1"),
        help="with --like: keep the first N layers (a shallow copy for tests)",
    )
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
        with_overrides = args.command in ("submit", "update")
        if not with_overrides or not all("=" in e and not e.startswith("-") for e in extra):
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
