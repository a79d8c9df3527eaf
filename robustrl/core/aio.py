"""Small asyncio pieces every service needs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from robustrl.core.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0

EXIT_TASK_WAIT_S = 5.0
"""The longest a service process waits, as it exits, for its tasks to end once cancelled."""


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks (None is skipped) and wait until each has finished unwinding."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def raise_if_cancelled() -> None:
    """Raise CancelledError if this task was cancelled and something it awaited swallowed it
    (a library's `except CancelledError: pass`): a retry loop must not go on for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def cancel_leftover_tasks(loop: asyncio.AbstractEventLoop, wait_s: float) -> set[asyncio.Task[Any]]:
    """The last step of asyncio.run (asyncio.runners._cancel_all_tasks), bounded: cancel the
    loop's tasks and run the loop until they end, but at most `wait_s`; returns the tasks
    still running then. Unbounded, one task that ignores its cancellation keeps the process
    from ever exiting: in a test run an aetcd watch stream's task (Watcher._handle_request,
    inside its gRPC Watch call) once did, and the suite stood still. Like asyncio.run, it hands
    what a task that ended raised to the loop's exception handler."""
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return set()
    for task in tasks:
        task.cancel()
    ended, stuck = loop.run_until_complete(asyncio.wait(tasks, timeout=wait_s))
    for task in ended:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception while the event loop closed",
                    "exception": task.exception(),
                    "task": task,
                }
            )
    return stuck


def run_process(main: Coroutine[Any, Any, T], stuck_wait_s: float = EXIT_TASK_WAIT_S) -> T:
    """asyncio.run for a service's main: the same steps, but the wait for tasks to end once
    cancelled is bounded (cancel_leftover_tasks). Tasks still running after `stuck_wait_s`
    are named in an error line (`process.tasks_stuck_at_exit`) and left behind: the process
    exits instead of hanging until whoever stops it kills it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            stuck = cancel_leftover_tasks(loop, stuck_wait_s)
            if stuck:
                # Their async generators and executor jobs may be stuck with them: not awaited.
                log.error(
                    "process.tasks_stuck_at_exit",
                    waited_s=stuck_wait_s,
                    tasks=sorted(repr(task)[:300] for task in stuck),
                )
            else:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def retry_while(
    call: Callable[[], Awaitable[T]],
    transient: Callable[[BaseException], bool],
    *,
    waiting: str,
    answered: str,
    on_wait: Callable[[], None] | None = None,
    between: Callable[[], Awaitable[object]] | None = None,
    **context: Any,
) -> T:
    """`call()`, made again for as long as it fails with an error `transient` accepts (0.2 s
    after the first failure, doubling to 2 s between tries); any other error is raised.

    For work that must wait out an outage rather than give up. Logs the event `waiting` once,
    on the first failure, and `answered` with the seconds waited when a call goes through
    after it, both with `context`. `on_wait` is called once, on that first failure;
    `between` is awaited after every failure, before the pause (what may end the outage)."""
    delay = RETRY_FIRST_S
    since: float | None = None
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not transient(exc):
                raise
            raise_if_cancelled()
            if since is None:
                since = time.monotonic()
                log.warning(waiting, error=str(exc)[:200], **context)
                if on_wait is not None:
                    on_wait()
            if between is not None:
                await between()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        if since is not None:
            log.info(answered, waited_s=round(time.monotonic() - since, 1), **context)
        return result
