"""Test processes forked from a warm template (`robustrl/core/template.py`) instead of started
as fresh interpreters: a file that starts dozens of processes importing torch pays for the
imports once. A ForkedProcess is driven like `asyncio.subprocess.Process` over pipes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from robustrl.core.template import new_socket_path, request_fork, template_argv
from tests.support.paths import REPO

READY_TIMEOUT_S = 60.0


class ForkedProcess:
    """A child of the template (not of the test): `returncode` is -1 once it has exited (the
    template's kernel reaps it; its status is not seen here), None while it runs."""

    def __init__(
        self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader, pidfd: int
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self._pidfd = pidfd
        self.returncode: int | None = None

    def _exited(self) -> bool:
        # A pidfd reads as ready once its process has ended, whoever reaps it.
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = -1
        return self.returncode is not None

    async def wait(self) -> int:
        if not self._exited():
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()

            def end() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(self._pidfd, end)
            try:
                await ended
            finally:
                loop.remove_reader(self._pidfd)
            self.returncode = -1
        self._close()
        return -1

    def kill(self) -> None:
        if not self._exited():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        self.stdin.close()


class Template:
    """A template process that preloaded `modules`, for this test process; it exits with it."""

    def __init__(self, *modules: str) -> None:
        self.socket = new_socket_path()
        self._log = self.socket.with_name("template.log")
        with self._log.open("wb") as log:
            self.proc = subprocess.Popen(
                template_argv(self.socket, modules),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the test template did not serve:\n{self._log.read_text()}")
            time.sleep(0.05)

    async def spawn(
        self, module: str, args: list[str], env: dict[str, str], stderr: Path
    ) -> ForkedProcess:
        """`python -m module args` forked from the template, stdin and stdout piped to this
        process, stderr to the file `stderr`."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pid, _argv = await asyncio.to_thread(
                request_fork,
                self.socket,
                module,
                env,
                args=tuple(args),
                stdio=(stdin_r, stdout_w, err),
            )
        except BaseException:
            for fd in (stdin_w, stdout_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w, err):
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdout_r, "rb", 0)
        )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(stdin_w, "wb", 0)
        )
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return ForkedProcess(pid, writer, reader, pidfd)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


@contextlib.contextmanager
def template(*modules: str) -> Iterator[Template]:
    started = Template(*modules)
    try:
        started.wait_ready()
        yield started
    finally:
        started.close()
