"""What every command starts from: the local stack's home, the etcd it talks to, a connected
client, and the error for input the CLI rejects before asking the stack (exit 2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from robustrl.cli import stack
from robustrl.cli.client import StackClient
from robustrl.core.aio import run_process

DEFAULT_HOME = ".robustrl"


class UsageError(Exception):
    """Input the CLI rejects before asking the stack (exit 2)."""


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
