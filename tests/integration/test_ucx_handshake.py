"""ucxx's connection handshake as a holder's listener sees it, on real UCX endpoints."""

from __future__ import annotations

import asyncio

import pytest

from services.common.logs import configure_logging
from services.common.ucx_transport import load_ucxx


async def test_a_peer_that_connects_and_never_shakes_hands_is_logged_in_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A real listener and a raw UCX endpoint to it that never sends its half of the handshake,
    as a puller killed or frozen mid-connect: the listener's wait times out. ucxx logged that
    at ERROR as an unexpected error with two tracebacks (three of them in a rollout's log after
    a chaos run); it is one warning line now, and the listener goes on serving.
    (A peer killed mid-handshake resets the connection instead; the same line names that.)"""
    configure_logging(service="test", instance="handshake", level="info")
    ucxx = load_ucxx()
    accepted: list[object] = []
    listener = ucxx.create_listener(accepted.append, connect_timeout=0.3)
    worker = ucxx.core._get_ctx().worker
    silent = ucxx._lib.libucxx.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)
    try:
        await asyncio.sleep(1.0)
        dropped = ucxx._lib.libucxx.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)
        await asyncio.sleep(0.05)
        dropped.close()  # gone before its half of the handshake, as a killed puller
        await asyncio.sleep(1.0)
        err = capfd.readouterr().err
        failed = [line for line in err.splitlines() if "ucx.handshake_failed" in line]
        assert len(failed) == 2 and "TimeoutError" in failed[0], err
        assert "Unexpected error in listener handler" not in err and "Traceback" not in err
        assert accepted == []

        endpoint = await ucxx.create_endpoint("127.0.0.1", listener.port)  # still serving
        await endpoint.close()
    finally:
        silent.close()
        listener.close()
