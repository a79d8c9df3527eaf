"""One record that many requests change, written by one writer: changes made while a write is
in flight share the next one (group commit; docs/decisions/0008).

The leader rewrites a job's work ledger after every lease and every completion. A request
changes the ledger under the job's lock, lets go of the lock, and waits for a write that began
after its change (`changed`). Only one write per record is in flight; whatever changed while
it was, the next write carries, so the writes a job makes follow etcd's latency rather than
the number of requests.

A caller must not answer before its change is stored (a new leader trusts only etcd): it
awaits the future `changed` returns, which fails with the write's error if the write does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from robustrl.core.aio import cancel_and_wait


class CoalescedWrites:
    """Serial writes of one record: `write` stores the record as it is when it is called (it
    must read the record before its first await)."""

    def __init__(self, write: Callable[[], Awaitable[None]]) -> None:
        self._write = write
        self._changes = 0
        """Changes announced (`changed`)."""
        self._settled = 0
        """Changes a write that ended (landed or failed) carried."""
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        """Writes attempted (for tests and logs)."""

    def changed(self) -> asyncio.Future[None]:
        """Announce a change just made; the future resolves once a write that began after it
        has landed, or fails with that write's error. Call it in the same turn of the loop as
        the change (before any await)."""
        self._changes += 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((self._changes, done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="coalesced-writes")
        return done

    async def stop(self) -> None:
        """Cancel the write in flight; every waiter is cancelled."""
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while self._settled < self._changes:
            covered = self._changes  # what this write carries: every change announced so far
            self.writes += 1
            try:
                await self._write()
            except asyncio.CancelledError:
                self._settle(self._changes, None, cancel=True)
                raise
            except Exception as exc:
                # Its waiters fail as a write of their own would have; changes announced
                # meanwhile get a write of their own (which carries these too).
                self._settled = covered
                self._settle(covered, exc)
                continue
            self._settled = covered
            self._settle(covered, None)

    def _settle(self, covered: int, error: Exception | None, cancel: bool = False) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for change, done in self._waiting:
            if change > covered:
                keep.append((change, done))
            elif done.done():
                continue
            elif cancel:
                done.cancel()
            elif error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)
        self._waiting = keep
