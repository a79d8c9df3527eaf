"""How the event loop drives a ucxx worker: ucxx's blocking progress mode, mended so that a
process with nothing to move sleeps.

UCX's contract for waiting on a worker is progress, then arm, then wait on its epoll fd; an
arm that finds events pending answers busy and the caller progresses again. ucxx 0.52's
blocking mode (`BlockingMode`) adds a reader on that fd and arms the worker once, at the
start. Its reader callback progresses the worker but never arms it again, so after the first
message the fd stays readable and the event loop runs the callback on every turn. Every
process that had moved weights once spun like that for the rest of its life. A minimal
two-endpoint ucxx program used 1.45 s of CPU in 3 s idle; 0.00 s with `install`.

`install` replaces two methods of the mode:
- **The reader callback** progresses the worker, then keeps progressing it on every turn of
  the loop while UCX makes progress and for `HOT_S` after. Only then does it arm the worker
  and leave the loop to sleep until the fd wakes it. A transfer that pauses between events
  (a rendezvous waiting for its peer) finds the worker still being progressed. The simplest
  mend, arming as soon as the loop was idle, halved 256 MiB pulls here: 5.7 GB/s against
  10.8.
- **The watchdog.** Some completions raise no event; a receive failed by aborting its
  endpoint is one. ucxx's watchdog progressed an idle worker once a second. Ours does so
  every `PROGRESS_INTERVAL`, then arms it again. Before, a puller took 1.9 s to leave a
  holder whose record was withdrawn, against 0.03 s while the loop spun.

What this does not change: in this mode a coroutine that awaits a UCX request polls it on
every turn of the loop (ucxx's `wait_yield`), so a receive left posted keeps the loop busy.
A holder waits for a puller's next request with such a receive, so a puller closes an
endpoint it has not used for `UcxTransport.park_seconds`: the holder's receive then fails,
its wait ends, and its loop sleeps.

Nothing here runs unless `install` finds the mode as described: a ucxx that changed it is
left alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

PROGRESS_INTERVAL = 0.02
"""Seconds: the longest a completion that raises no event waits to be seen."""

HOT_S = 0.005
"""Seconds a worker is still progressed on every turn of the loop after its last progress.
Measured: 5 ms and 20 ms pull 64-256 MiB as fast as the spinning mode."""


def install() -> None:
    """Mend ucxx's blocking progress mode for every worker made after this call. Idempotent."""
    from ucxx._lib_async import continuous_ucx_progress as progress

    mode: Any = progress.BlockingMode
    if getattr(mode, "_robustrl_mended", False):
        return
    if not all(hasattr(mode, name) for name in ("_arm_worker", "_progress_with_timeout")):
        return
    original_init = mode.__init__

    def init(self: Any, worker: Any, event_loop: Any, progress_timeout: float = 1.0) -> None:
        original_init(self, worker, event_loop, min(progress_timeout, PROGRESS_INTERVAL))

    mode.__init__ = init
    mode._fd_reader_callback = _on_event
    mode._progress_with_timeout = _watchdog
    mode._robustrl_mended = True


def _on_event(self: Any) -> None:
    """The worker's fd is readable: progress it, and keep at it while there is work."""
    self.worker.progress()
    _keep_progressing(self)


def _keep_progressing(self: Any) -> None:
    task = self.arm_task
    if task is None or task.done():
        self.arm_task = self.event_loop.create_task(_progress_until_quiet(self))


async def _progress_until_quiet(self: Any) -> None:
    """Progress on every turn of the loop until nothing has progressed for HOT_S and the
    worker arms (an arm answers busy while events are pending)."""
    active = time.monotonic()
    while True:
        worker = self.worker
        if worker is None:
            return
        now = self.last_progress_time = time.monotonic()
        if worker.progress_once():
            active = now
            while worker.progress_once():
                pass
        elif now - active > HOT_S and worker.arm():
            return
        await asyncio.sleep(0)


async def _watchdog(self: Any) -> None:
    """Progress a worker that nothing has progressed for an interval, and arm it again."""
    while True:
        await asyncio.sleep(self._progress_timeout)
        worker = self.worker
        if worker is None:
            return
        if time.monotonic() - self.last_progress_time < self._progress_timeout:
            continue
        self.last_progress_time = time.monotonic()
        worker.progress()
        if not worker.arm():
            _keep_progressing(self)
