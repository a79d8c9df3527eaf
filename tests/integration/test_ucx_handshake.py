"""ucxx's connection handshake as a holder's listener sees it, on real UCX endpoints."""

from __future__ import annotations

import asyncio
import logging

from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.transport import load_ucxx
from tests.support import eventually

FAILED_WITHIN = 10.0
"""Seconds a handshake's failure may take to be counted: its 0.3 s timeout, and a busy host."""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_a_peer_that_connects_and_never_shakes_hands_is_logged_in_one_line() -> None:
    """A real listener, a raw UCX endpoint to it that never sends its half of the handshake
    (as a puller frozen mid-connect: the listener's wait times out) and one that closes before
    it (as a puller killed then: the connection is reset). ucxx logged each at ERROR as an
    unexpected error with two tracebacks (three of them in a rollout's log after a chaos run);
    now nothing reaches ucxx's log, each is one line of ours (`ucx.handshake_failed`, counted
    in `failed_handshakes`), and the listener goes on serving."""
    ucxx = load_ucxx()
    records = _Records()
    logging.getLogger("ucx").addHandler(records)
    failed_before = ucx_progress.failed_handshakes
    accepted: list[object] = []
    listener = ucxx.create_listener(accepted.append, connect_timeout=0.3)
    worker = ucxx.core._get_ctx().worker
    silent = ucxx._lib.libucxx.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)

    async def failed(count: int) -> bool:
        return ucx_progress.failed_handshakes - failed_before >= count

    try:
        # The listener's wait for the silent one's half times out after connect_timeout; the
        # bound leaves a loaded host room, and a failure never counted fails here.
        await eventually(lambda: failed(1), timeout=FAILED_WITHIN)
        dropped = ucxx._lib.libucxx.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)
        await asyncio.sleep(0.05)
        dropped.close()  # gone before its half of the handshake
        await eventually(lambda: failed(2), timeout=FAILED_WITHIN)

        assert ucx_progress.failed_handshakes - failed_before == 2
        assert not [m for m in records.messages if "listener handler" in m], records.messages
        assert accepted == []
        endpoint = await ucxx.create_endpoint("127.0.0.1", listener.port)  # still serving
        await endpoint.close()
    finally:
        logging.getLogger("ucx").removeHandler(records)
        silent.close()
        listener.close()
