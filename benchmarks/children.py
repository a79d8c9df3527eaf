"""What the benchmarks that start their own processes share: an etcd of the run's own on
free ports, and a child process driven by one JSON line per command on its stdin, answering
one JSON line per reply on its stdout (each stopped by pid)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any


def start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """An etcd with its data under `workdir`, healthy: the process and its client endpoint."""
    from robustrl.cli.stack import etcd_argv, etcd_healthy, free_port

    client, peer = free_port(), free_port()
    endpoints = f"127.0.0.1:{client}"
    etcd = subprocess.Popen(
        [*etcd_argv("bench", workdir / "etcd", client, peer), "--log-level=error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not etcd_healthy(endpoints):
        if time.monotonic() > deadline or etcd.poll() is not None:
            etcd.kill()
            raise RuntimeError("etcd did not start")
        time.sleep(0.1)
    return etcd, endpoints


def stop_etcd(etcd: subprocess.Popen[bytes] | None) -> None:
    if etcd is not None:
        etcd.terminate()
        etcd.wait(10)


class Child:
    """A child process as its driver sees it: commands go out with an id, replies come back
    with it, in any order."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self._ids = 0
        self._replies: dict[int, dict[str, Any]] = {}

    async def line(self, timeout: float) -> dict[str, Any]:
        """The next line the child writes (a reply, or an event such as `ready`)."""
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise RuntimeError(f"{self.name} died:\n{self.log.read_text()[-3000:]}")
        message: dict[str, Any] = json.loads(raw)
        return message

    def send(self, cmd: str, **fields: Any) -> int:
        assert self.proc.stdin is not None
        self._ids += 1
        self.proc.stdin.write((json.dumps({"cmd": cmd, "id": self._ids, **fields}) + "\n").encode())
        return self._ids

    async def reply(self, request_id: int, timeout: float = 600) -> dict[str, Any]:
        while request_id not in self._replies:
            message = await self.line(timeout)
            self._replies[message["id"]] = message
        return self._replies.pop(request_id)

    async def call(self, cmd: str, timeout: float = 600, **fields: Any) -> dict[str, Any]:
        return await self.reply(self.send(cmd, **fields), timeout)

    async def stop(self) -> None:
        """Ask the child to exit; SIGKILL it if it has not within 15 s."""
        if self.proc.returncode is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self.send("exit")
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
