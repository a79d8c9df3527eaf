"""Small asyncio pieces every service needs."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task[None] | None) -> None:
    """Cancel the tasks (None is skipped) and wait until each has finished unwinding."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
