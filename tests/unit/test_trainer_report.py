"""A stopped trainer's error report goes until the leader has heard it (report_until_heard)."""

from __future__ import annotations

import grpc
import pytest

from services.trainer.reporting import report_until_heard


def refusal(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def test_a_report_that_fails_is_sent_again_until_it_is_heard() -> None:
    """What the leader answered under NOSPACE (UNKNOWN), then an error of our own: the report
    goes again each time, and once more after, where it used to be dropped after the first."""
    failures: list[BaseException] = [
        refusal(grpc.StatusCode.UNKNOWN, "etcdserver: mvcc: database space exceeded"),
        RuntimeError("channel closed"),
    ]
    sent: list[int] = []

    async def send() -> None:
        sent.append(len(sent))
        if failures:
            raise failures.pop(0)

    assert await report_until_heard(send, first_delay=0.01) is True
    assert sent == [0, 1, 2]


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    ],
)
async def test_an_answer_that_will_never_change_ends_the_tries(code: grpc.StatusCode) -> None:
    sent: list[int] = []

    async def send() -> None:
        sent.append(1)
        raise refusal(code, "this trainer no longer serves job j")

    assert await report_until_heard(send, first_delay=0.01) is False
    assert sent == [1]
