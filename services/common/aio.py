"""Small asyncio pieces every service needs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks (None is skipped) and wait until each has finished unwinding."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
