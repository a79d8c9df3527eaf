"""A trainer's progress reports to the coordinator's leader: each step's, for as long as no
leader answers, and a stopped trainer's error report, until the leader has heard it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.logs import get_logger
from robustrl.v1 import coordinator_pb2

log = get_logger(__name__)

REPORT_DEADLINE = 10.0

FINAL_REPORT_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    }
)
"""Answers to a report that sending it again cannot change."""


async def report_until_heard(
    send: Callable[[], Awaitable[object]], first_delay: float = 0.5, max_delay: float = 10.0
) -> bool:
    """Send a stopped trainer's error report until the leader has heard it (True), or has
    answered that it never will (False: FINAL_REPORT_CODES, as when the trainer was fenced).
    A stopped trainer has no hang budget, so a report lost on the way would leave its job
    waiting for ever (as when etcd is out of space and the leader answers UNKNOWN:
    docs/decisions/0302). Any other failure is logged and the report sent again, `first_delay`
    doubling up to `max_delay`."""
    delay = first_delay
    while True:
        try:
            await send()
            return True
        except grpc.aio.AioRpcError as refused:
            if refused.code() in FINAL_REPORT_CODES:
                log.warning("trainer.error_not_reported", reason=refused.details())
                return False
            failure = f"{refused.code().name}: {refused.details()}"
        except Exception as other:  # anything else: say so and try again
            failure = repr(other)
        log.warning("trainer.error_report_failed", error=failure[:200], retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


async def report_to_coordinator(
    client: CoordinatorClient,
    request: coordinator_pb2.ReportProgressRequest,
    on_wait: Callable[[], None] | None = None,
) -> coordinator_pb2.ReportProgressResponse:
    """ReportProgress to the leader, for as long as no leader answers
    (`CoordinatorClient.write_until_answered`). Training cannot go on without its reports:
    the coordinator decides whether the job goes on, and for how many steps. A report sent
    again is safe: the coordinator ignores the groups it settled already."""
    reply: coordinator_pb2.ReportProgressResponse = await client.write_until_answered(
        lambda s: s.ReportProgress(request, timeout=REPORT_DEADLINE),
        on_wait=on_wait,
        doing="reporting progress",
        step=request.step,
    )
    return reply
