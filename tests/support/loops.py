"""Closing a test's event loop in bounded time, naming the tasks that would not end."""

from __future__ import annotations

import asyncio
import asyncio.runners

from robustrl.core.aio import cancel_leftover_tasks

STUCK_TASK_WAIT_S = 15.0
"""The longest a test's event loop waits, as it closes, for its tasks to end once cancelled."""


def cancel_all_tasks_or_name_the_stuck(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio.Runner's last step (asyncio.runners._cancel_all_tasks), bounded the way a
    service's main bounds it (robustrl.core.aio.cancel_leftover_tasks), but failing the test
    that left tasks which did not end within STUCK_TASK_WAIT_S of being cancelled, naming them.
    pytest-timeout does not help there: it had fired already, or fires once."""
    stuck = cancel_leftover_tasks(loop, STUCK_TASK_WAIT_S)
    if stuck:
        raise RuntimeError(
            f"{len(stuck)} task(s) did not end within {STUCK_TASK_WAIT_S}s of being cancelled"
            f" as the test's event loop closed: {sorted(repr(t) for t in stuck)}"
        )
