"""Reading a local stack's state in the test's process: one etcd client with persistent
channels on an event loop of its own thread, giving the same JSON that `robustrl ... --json`
prints (the CLI's own read functions build it). Polls through it cost milliseconds; a cold
`python -m robustrl.cli.main` costs seconds of CPU on two busy cores, and the e2e and chaos
tests poll every 0.1-0.2 s."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from robustrl.cli.client import StackClient
from robustrl.cli.inspect_commands import dropped_of, member_rows
from robustrl.cli.job_commands import job_list, job_status, stack_summary

T = TypeVar("T")

READ_TIMEOUT_S = 120.0
"""The longest one read may take (the CLI subprocess had the same bound): etcd may be stopped
under test, and a read during that outage waits for it."""


class StackReader:
    def __init__(self, endpoints: str, prefix: str) -> None:
        self.endpoints = endpoints
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="stack-reader", daemon=True
        )
        self._thread.start()
        self._client = self._run(StackClient.connect(endpoints, prefix))

    def _run(self, call: Awaitable[T], timeout: float = READ_TIMEOUT_S) -> T:
        async def wrapped() -> T:
            return await call

        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result(timeout)

    def call(self, work: Callable[[StackClient], Awaitable[T]], timeout: float) -> T:
        """`work` on the reader's client, in its loop: a command's own code, run in the test's
        process where a cold CLI start would come too late for what the test follows."""
        return self._run(work(self._client), timeout)

    def _json(self, read: Callable[[StackClient], Awaitable[Any]]) -> Any:
        # Through JSON, as the CLI prints it: the same types a test of the CLI's output sees.
        return json.loads(json.dumps(self._run(read(self._client)), sort_keys=True))

    @staticmethod
    def serves(command: str, *args: str) -> bool:
        """Whether `read` answers `robustrl COMMAND ARGS --json` (else run the CLI for it)."""
        arity = {"status": (0, 1), "members": (0,), "jobs": (0,), "incidents": (0, 1)}
        return len(args) in arity.get(command, (1,) if command == "dropped" else ())

    def read(self, command: str, *args: str) -> Any:
        """What `robustrl COMMAND ARGS --json` prints, parsed (a command it `serves`)."""
        if command == "status" and len(args) == 1:
            return self._json(lambda c: job_status(c, args[0], self.endpoints))
        if command == "status" and not args:
            return self._json(stack_summary)
        if command == "members" and not args:
            return self._json(member_rows)
        if command == "jobs" and not args:
            return self._json(job_list)
        if command == "incidents" and len(args) <= 1:
            return self._json(lambda c: c.incidents(args[0] if args else ""))
        if command == "dropped" and len(args) == 1:
            return self._json(lambda c: dropped_of(c, args[0]))
        raise ValueError(f"not read in-process: {command} {' '.join(args)}")

    def close(self) -> None:
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
