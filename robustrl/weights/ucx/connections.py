"""A puller's endpoints to holders: one request-and-buckets exchange at a time on each, a guard
that ends an exchange with a holder that left or stalled, and the endpoints kept between pulls.

An endpoint stays open after a pull that completed on it (parked), for the next pull from the
same holder: a job that pulls every step keeps its endpoints, an idle one gives its holders
theirs back after park_seconds. Opening one costs more than a small pull's transfer
(docs/decisions/0111).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from robustrl.weights.protocol import (
    BAD_REPLY,
    MAX_CONTROL_BYTES,
    FrameError,
    HolderRefused,
    PullReply,
    PullRequest,
    bucket_nbytes,
    bucket_ranges,
    data_tag,
)
from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.buffers import ucx_buffer
from robustrl.weights.ucx.counters import TransferCounters
from robustrl.weights.ucx.lifetime import Lifetime
from robustrl.weights.ucx.listeners import ABORT_NS

MAX_IDLE_CONNECTIONS = 4  # endpoints kept open between pulls, to the holders used last
PARK_SECONDS = 2.0
"""How long a puller keeps an endpoint it does not use: a job that pulls every step keeps its
endpoints, an idle one gives its holders theirs back. A kept endpoint costs the holder nothing
while it waits (progress.receive_message)."""


class SourceLeft(Exception):
    """The holder a pull was receiving from deleted its record: its lease expired, it closed,
    or the coordinator fenced it. A stopped (SIGSTOP) holder would otherwise be waited on
    until the stall timeout."""


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"UCX address {address!r} is not host:port")
    return host, int(port)


class HolderConnection:
    """One puller's endpoint to one holder: request buckets, receive them into place."""

    def __init__(self, endpoint: Any, address: str) -> None:
        self._ep = endpoint
        self.address = address
        self._seq = 0
        self.parks = 0  # times a puller kept it between pulls

    @classmethod
    async def open(cls, maker: Any, address: str, timeout: float) -> HolderConnection:
        """An endpoint to the holder at address, made by `maker`: the ucxx module or a ucxx
        context (progress.pull_context)."""
        host, port = _split_address(address)
        endpoint = await asyncio.wait_for(
            maker.create_endpoint(host, port, connect_timeout=timeout), timeout + 1.0
        )
        return cls(endpoint, address)

    async def request(
        self, job_id: str, version: int, digest: str, buckets: Sequence[int]
    ) -> tuple[int, list[tuple[int, int]]]:
        """Ask for buckets (in ascending order); (seq, [(index, nbytes)]) or HolderRefused with
        the holder's reason.

        No timeout here or in receive: a SourceGuard bounds both by aborting the endpoint."""
        self._seq += 1
        request = PullRequest(self._seq, job_id, version, digest, bucket_ranges(buckets))
        with self._aborted_is_reset():
            await ucx_progress.send_message(self._ep, request.encode())
            try:
                raw = await ucx_progress.receive_message(self._ep, MAX_CONTROL_BYTES)
            except FrameError as exc:  # a holder of another protocol: pull elsewhere
                raise HolderRefused(
                    BAD_REPLY, f"protocol mismatch with {self.address}: {exc}"
                ) from exc
        try:
            reply = PullReply.decode(raw)
            if reply.seq != self._seq or reply.buckets != len(buckets):
                raise ValueError(f"answers request {reply.seq} with {reply.buckets} buckets")
            size, total = reply.bucket_bytes, reply.total_bytes
            return self._seq, [(i, bucket_nbytes(i, size, total)) for i in buckets]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            detail = f"unreadable reply from {self.address}: {exc!r}"
            raise HolderRefused(BAD_REPLY, detail) from exc

    async def receive(self, into: torch.Tensor, seq: int, index: int) -> None:
        with self._aborted_is_reset():
            await self._ep.recv(ucx_buffer(into), tag=data_tag(seq, index))

    @contextlib.contextmanager
    def _aborted_is_reset(self) -> Iterator[None]:
        """An endpoint aborted under a call (by a SourceGuard, between a request and its
        reply, say) fails it as a reset connection, a source failure a pull recovers from.
        ucxx raises AttributeError there: its endpoint's handle is gone (docs/decisions/0113)."""
        try:
            yield
        except AttributeError as exc:
            if not self._ep.closed:
                raise
            raise ConnectionResetError(f"endpoint to {self.address} was aborted") from exc

    async def close(self) -> None:
        # abort() also cancels receives still posted into our buffer, so a late byte from a
        # source we gave up on can never land in a bucket another holder filled.
        with contextlib.suppress(Exception):
            # A bounded wait: a frozen peer must not hold the event loop for long.
            self._ep.abort(period=ABORT_NS)


class SourceGuard:
    """Ends an exchange with one holder by aborting its endpoint: once the holder's record is
    gone (`gone` is set), or once nothing has come from it for `stall` seconds.

    Aborting lets UCX fail the pending operations itself. Cancelling them from Python instead
    (a timeout around a receive) would release buffers UCX may still write into
    (docs/decisions/0113). A stopped holder keeps its endpoint open, so without this guard a
    receive from it would never end.

    Use it around the exchange (`async with`): on the way out it stops watching and turns a
    `translate` error the abort caused into SourceLeft or TimeoutError.
    """

    def __init__(
        self,
        conn: HolderConnection,
        holder: str,
        gone: asyncio.Event,
        stall: float,
        translate: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    ) -> None:
        self._conn = conn
        self.holder = holder
        self._gone = gone
        self._stall = stall
        self._translate = translate
        self._last = time.monotonic()
        self._task = asyncio.ensure_future(self._run())

    async def __aenter__(self) -> SourceGuard:
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._task.cancel()
        if exc is None or not isinstance(exc, self._translate):
            return
        why = self.why()
        if why == "left":
            raise SourceLeft(f"holder {self.holder} left the holders") from exc
        if why == "stalled":
            raise TimeoutError(
                f"nothing came from holder {self.holder} for {self._stall}s"
            ) from exc

    def progressed(self) -> None:
        self._last = time.monotonic()

    def why(self) -> str | None:
        """'left' or 'stalled' once the guard has aborted the endpoint, else None."""
        if not self._task.done() or self._task.cancelled():
            return None
        return "left" if self._gone.is_set() else "stalled"

    async def _run(self) -> None:
        while not self._gone.is_set():
            left = self._last + self._stall - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gone.wait(), left)
        await self._conn.close()


class Endpoints:
    """The endpoints one puller opens to holders, and those it keeps between pulls (at most
    MAX_IDLE_CONNECTIONS, each for park_seconds after its last use)."""

    def __init__(
        self,
        maker: Callable[[], Any],
        *,
        connect_timeout: float,
        park_seconds: float,
        counters: TransferCounters,
        lifetime: Lifetime,
    ) -> None:
        self._maker = maker
        self.connect_timeout = connect_timeout
        self.park_seconds = park_seconds
        self._counters = counters
        self._lifetime = lifetime
        self._idle: dict[str, HolderConnection] = {}  # holder address -> endpoint, between pulls

    async def connect(self, address: str) -> HolderConnection:
        """The endpoint kept from an earlier pull from address, else a new one (made by
        `maker()`). A kept endpoint whose holder died fails at once (the peer reset it), like a
        new one would: a source failure."""
        kept = self._idle.pop(address, None)
        if kept is not None:
            return kept
        conn = await HolderConnection.open(self._maker(), address, self.connect_timeout)
        self._counters.endpoints_opened += 1
        return conn

    async def park(self, conn: HolderConnection) -> None:
        """Keep an endpoint for the next pull; only one whose exchanges all completed, so no
        receive of ours is still posted on it."""
        if self._lifetime.closed or conn.address in self._idle:
            await conn.close()
            return
        self._idle[conn.address] = conn
        while len(self._idle) > MAX_IDLE_CONNECTIONS:
            await self._idle.pop(next(iter(self._idle))).close()
        conn.parks += 1
        self._lifetime.start(self._unpark_later(conn, conn.parks))

    async def _unpark_later(self, conn: HolderConnection, park: int) -> None:
        """Close a parked endpoint that no pull has taken since this park, park_seconds on."""
        await asyncio.sleep(self.park_seconds)
        if self._idle.get(conn.address) is conn and conn.parks == park:
            del self._idle[conn.address]
            await conn.close()

    async def close(self) -> None:
        """Close every kept endpoint."""
        for conn in self._idle.values():
            await conn.close()
        self._idle.clear()


async def ask_holder(
    maker: Any,
    address: str,
    job_id: str,
    version: int,
    *,
    digest: str = "",
    buckets: Sequence[int] = (0,),
    timeout: float = 10.0,
) -> list[tuple[int, int]]:
    """Ask one holder whether it can serve these buckets, over a new endpoint made by `maker`
    (diagnostics and tests).

    Returns [(index, nbytes)] and receives the data into a scratch buffer, or raises
    HolderRefused carrying the holder's error code and message.
    """
    conn = await HolderConnection.open(maker, address, timeout)
    try:
        async with SourceGuard(conn, address, asyncio.Event(), timeout) as guard:
            seq, sizes = await conn.request(job_id, version, digest, buckets)
            for index, nbytes in sizes:
                guard.progressed()
                await conn.receive(torch.zeros(nbytes, dtype=torch.uint8), seq, index)
            return sizes
    finally:
        await conn.close()
