"""aio.retry_while when what it calls swallows the caller's cancellation."""

from __future__ import annotations

import asyncio
import contextlib

from robustrl.core.aio import retry_while
from tests.support import eventually


async def test_a_retry_loop_ends_when_its_call_swallowed_the_cancel() -> None:
    """A library that awaits under `except CancelledError: pass` (aetcd's watch-stream
    shutdown does) loses the cancel aimed at its caller; the loop must not retry for ever."""
    calls = 0

    async def swallows_then_fails() -> None:
        nonlocal calls
        calls += 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)  # not a wait: a call that hangs until it is cancelled
        raise ConnectionError("etcd is unreachable")

    task = asyncio.create_task(
        retry_while(
            swallows_then_fails, lambda exc: True, waiting="test.waiting", answered="test.answered"
        )
    )

    async def calling() -> bool:  # the call is under way, hanging in its sleep
        return calls > 0

    await eventually(calling, timeout=5)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert task in done and task.cancelled()
    assert calls == 1
