"""A UCX transport's lifetime: the tasks its parts run beside their calls, and whether it is
closing. Every part starts its background work here, so closing the transport cancels all of
it in one place."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class Lifetime:
    """The background tasks of one transport; `closed` once it began to close."""

    def __init__(self) -> None:
        self.closed = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks still running (a copy)."""
        return list(self._tasks)

    def start(
        self,
        work: Coroutine[Any, Any, None],
        name: str | None = None,
        *,
        until_closed: bool = False,
    ) -> None:
        """Run work as a task of this transport's, cancelled by `end`. Work meant to run
        `until_closed` (the transport's own loops) stays listed if it ends before: `end` then
        raises what it raised."""
        task = asyncio.create_task(work, name=name)
        self._tasks.append(task)
        if not until_closed:
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def end(self) -> None:
        """Mark the transport closed, then cancel every task and wait for it to stop."""
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
