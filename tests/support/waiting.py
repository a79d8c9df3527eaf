"""Helpers the tests share: waiting for a condition instead of sleeping, stopping a process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.05
) -> float:
    """Wait until predicate() is true; return the seconds it took. Fails at timeout."""
    started = time.monotonic()
    while True:
        if await predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def eventually_sync(
    predicate: Callable[[], bool],
    timeout: float,
    interval: float = 0.1,
    *,
    unmet: Callable[[], str] | None = None,
) -> float:
    """Wait until predicate() is true; return the seconds it took. Fails at timeout, saying
    unmet() when given (what was awaited, what was seen instead)."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(unmet() if unmet else f"condition not met within {timeout}s")
        time.sleep(interval)
