"""A service process that a native fault kills says where each of its threads was."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from robustrl.contracts.keys import KeySpace
from robustrl.core.config import EtcdSettings, member_argv, member_env
from robustrl.core.registry import Registry
from tests.support import eventually

REPO = Path(__file__).resolve().parents[2]


async def test_a_native_fault_leaves_every_threads_python_stack_in_the_log(
    etcd_client: Any, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    """A fault in native code (UCX, torch, grpc) ends a process before any Python handler
    runs: a rollout of a demo run died so with not a line in its log. A service now writes
    each thread's Python stack to stderr (its log) first. A real monitor process gets a real
    SIGSEGV, sent by pid."""
    log_path = tmp_path / "monitor.log"
    env = {
        **os.environ,
        **member_env(etcd_settings.endpoints, etcd_settings.prefix, "monitor", "monitor-f"),
    }
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *member_argv("monitor"), cwd=REPO, env=env, stdout=log, stderr=log
        )
    try:
        registry = Registry(etcd_client, KeySpace(etcd_settings.prefix))

        async def registered() -> bool:
            return await registry.get("monitor", "monitor-f") is not None

        await eventually(registered, timeout=60)
        os.kill(proc.pid, signal.SIGSEGV)
        status = await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    text = log_path.read_text()
    assert status == -signal.SIGSEGV, text[-2000:]
    assert "Fatal Python error: Segmentation fault" in text, text[-2000:]
    # The main thread's stack, down to the event loop it was running.
    assert "most recent call first" in text and "asyncio/base_events.py" in text, text[-2000:]
