"""The holder's side of the UCX protocol: answer each puller's endpoint, request by request.

Every process that holds a version serves it (the trainer after publishing, a rollout after it
pulled and verified it). One task per accepted endpoint reads requests (protocol.PullRequest)
until the puller hangs up, checks each against what is held, and answers with an error reply
or an ok reply followed by the buckets asked for, IN_FLIGHT_BUCKETS sends posted ahead. The
holder counts its active pullers per version, refuses past max_pullers (busy), and has its
etcd record follow the count (records.HolderRecords.pullers_changed).

It waits for a puller's next request without polling (progress.receive_message): a kept
endpoint costs an idle holder nothing. Within one host the puller's worker copies the bytes
(CMA), and the holder only hears that each send is done.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robustrl.core.logs import get_logger
from robustrl.weights.protocol import (
    BAD_REQUEST,
    BUSY,
    DIGEST_MISMATCH,
    IN_FLIGHT_BUCKETS,
    MAX_CONTROL_BYTES,
    NO_SUCH_BUCKET,
    NOT_HELD,
    FrameError,
    HolderRefused,
    PullReply,
    PullRequest,
    data_tag,
    refusal_reply,
)
from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.buffers import ucx_buffer
from robustrl.weights.ucx.counters import TransferCounters
from robustrl.weights.ucx.held import HeldVersion, HeldVersions
from robustrl.weights.ucx.lifetime import Lifetime
from robustrl.weights.ucx.listeners import ABORT_NS

log = get_logger(__name__)


@dataclass(frozen=True)
class HolderFaults:
    """Test-only failure injection on the serving side, deterministic (no randomness).

    corrupt_buckets: bucket indexes sent with one byte flipped (the held buffer stays intact).
    stall_after_buckets: after serving this many buckets in total, stop sending (hang), so a
    test can kill the process mid-pull.
    """

    corrupt_buckets: frozenset[int] = frozenset()
    stall_after_buckets: int | None = None


class HolderServer:
    """Serves the held versions to pullers' endpoints (`serve` is the listener's callback)."""

    def __init__(
        self,
        held: HeldVersions,
        *,
        job_id: str,
        instance_id: str,
        max_pullers: int,
        counters: TransferCounters,
        lifetime: Lifetime,
        pullers_changed: Callable[[HeldVersion], None],
        faults: HolderFaults,
        in_flight: int = IN_FLIGHT_BUCKETS,
    ) -> None:
        self._held = held
        self._job_id = job_id
        self._instance_id = instance_id
        self.max_pullers = max_pullers
        self._counters = counters
        self._lifetime = lifetime
        self._pullers_changed = pullers_changed
        self.faults = faults
        self.in_flight = in_flight
        # What a failing puller raises while we send (the transport adds ucxx's errors).
        self.transfer_errors: tuple[type[BaseException], ...] = (TimeoutError, OSError)
        self.endpoints: set[Any] = set()  # pullers' endpoints open on this holder
        self._serving: set[asyncio.Task[Any]] = set()  # their handlers, cancelled on close

    async def serve(self, endpoint: Any) -> None:
        """One puller's connection: answer requests until it hangs up."""
        self.endpoints.add(endpoint)
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        try:
            while not self._lifetime.closed:
                try:
                    raw = await ucx_progress.receive_message(endpoint, MAX_CONTROL_BYTES)
                except FrameError as exc:
                    # Not a request of ours: the endpoint is out of step, so close it.
                    self._counters.requests_refused += 1
                    log.warning("weights.bad_request", error=str(exc)[:200])
                    return
                except Exception:
                    return  # the puller closed or died: nothing to answer
                try:
                    await self._answer(endpoint, raw)
                except self.transfer_errors as exc:
                    log.info("weights.serve_aborted", error=repr(exc)[:200])
                    return
        finally:
            self.endpoints.discard(endpoint)
            if task is not None:
                self._serving.discard(task)
            with contextlib.suppress(Exception):
                endpoint.abort(period=ABORT_NS)

    async def close(self) -> None:
        """Stop every connection handler and abort every puller's endpoint."""
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        for task in serving:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if serving:
            await asyncio.sleep(0)  # ucxx retires its handler records one loop turn later
        for endpoint in list(self.endpoints):
            with contextlib.suppress(Exception):
                endpoint.abort(period=ABORT_NS)
        self.endpoints.clear()

    def _check(self, request: PullRequest) -> tuple[HeldVersion, list[int]]:
        """The held version and bucket list a request asks for, or HolderRefused saying why."""
        request.check_form()
        version = request.version
        held = self._held.get(version) if request.job_id == self._job_id else None
        if held is None:
            raise HolderRefused(
                NOT_HELD,
                f"holder {self._instance_id} holds versions {self._held.versions()} of job "
                f"{self._job_id}, not version {version} of job {request.job_id}",
                self._held.versions(),
            )
        if request.digest and request.digest != held.manifest.digest:
            raise HolderRefused(
                DIGEST_MISMATCH,
                f"holder {self._instance_id} holds a different version {version} "
                f"(trainer epoch {held.manifest.trainer_epoch})",
                self._held.versions(),
            )
        buckets = request.bucket_indexes(len(held.manifest.buckets), self._held.versions())
        outside = [index for index in buckets if not held.holds(index)]
        if outside:
            stop = len(held.manifest.buckets) if held.stop_bucket is None else held.stop_bucket
            raise HolderRefused(
                NO_SUCH_BUCKET,
                f"holder {self._instance_id} holds buckets {held.first_bucket}..{stop - 1} of "
                f"version {version}, not {outside[:8]}",
                self._held.versions(),
            )
        if self.max_pullers and held.active_pullers >= self.max_pullers:
            raise HolderRefused(BUSY, f"holder {self._instance_id} serves {held.active_pullers}")
        return held, buckets

    async def _answer(self, endpoint: Any, raw: bytes) -> None:
        seq = 0
        try:
            request = PullRequest.decode(raw)
            seq = request.seq
            held, buckets = self._check(request)
        except (ValueError, AttributeError, HolderRefused) as exc:
            refusal = (
                exc if isinstance(exc, HolderRefused) else HolderRefused(BAD_REQUEST, str(exc))
            )
            self._counters.requests_refused += 1
            await ucx_progress.send_message(endpoint, refusal_reply(seq, refusal))
            return
        # Take the slot before the first await, so two requests cannot both pass the cap.
        held.active_pullers += 1
        self._pullers_changed(held)
        try:
            manifest = held.manifest
            reply = PullReply(seq, len(buckets), manifest.bucket_bytes, manifest.total_bytes)
            await ucx_progress.send_message(endpoint, reply.encode())
            sends: collections.deque[asyncio.Future[Any]] = collections.deque()
            try:
                for index in buckets:
                    await self._maybe_stall(sum(not send.done() for send in sends))
                    view = held.bucket(index)
                    if index in self.faults.corrupt_buckets:
                        view = view.clone()
                        view[0] ^= 0xFF
                    send = asyncio.ensure_future(
                        ucx_progress.send(endpoint, ucx_buffer(view), data_tag(seq, index))
                    )
                    send.add_done_callback(functools.partial(self._count_sent, int(view.numel())))
                    sends.append(send)
                    if len(sends) >= self.in_flight:
                        await sends.popleft()
                while sends:
                    await sends.popleft()
            finally:
                for unsent in sends:
                    unsent.cancel()
                await asyncio.gather(*sends, return_exceptions=True)
        finally:
            held.active_pullers -= 1
            self._pullers_changed(held)

    def _count_sent(self, nbytes: int, send: asyncio.Future[Any]) -> None:
        if not send.cancelled() and send.exception() is None:
            self._counters.buckets_served += 1
            self._counters.bytes_served += nbytes

    async def _maybe_stall(self, in_flight: int) -> None:
        limit = self.faults.stall_after_buckets
        if limit is not None and self._counters.buckets_served + in_flight >= limit:
            log.warning("weights.fault_stall", served=self._counters.buckets_served)
            await asyncio.Event().wait()  # hang like a wedged process; the test kills us
