"""The test suite's bounded close of an event loop (tests/conftest.py): a task that ignores
its cancellation fails the test that left it, naming it, instead of hanging the run."""

from __future__ import annotations

import asyncio
import asyncio.runners

import pytest

from tests.support import loops


def test_a_task_that_ignores_cancellation_is_named_instead_of_hanging_the_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert asyncio.runners._cancel_all_tasks is loops.cancel_all_tasks_or_name_the_stuck  # type: ignore[attr-defined]
    monkeypatch.setattr(loops, "STUCK_TASK_WAIT_S", 0.2)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)  # not a wait: pending at the close, outliving the cancel
            except asyncio.CancelledError:
                continue  # as a task stuck in a call that never returns would

    async def done_at_once() -> None:
        await asyncio.sleep(10)  # not a wait: pending at the close, until its cancel

    loop = asyncio.new_event_loop()
    try:
        tasks = [
            loop.create_task(stubborn(), name="stubborn"),
            loop.create_task(done_at_once(), name="obliging"),
        ]
        loop.run_until_complete(asyncio.sleep(0))
        with pytest.raises(RuntimeError, match=r"1 task\(s\) did not end .*stubborn"):
            loops.cancel_all_tasks_or_name_the_stuck(loop)
        # Let it go, so that this test leaves no pending task behind.
        release.set()
        tasks[0].cancel()  # wakes it from its sleep; it sees the release and returns
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        assert tasks[1].cancelled() and tasks[0].done()
    finally:
        loop.close()
