"""The puller's side of the UCX protocol: choose a holder, pull the buckets still missing into
place, verify each as it lands, and pull again from another holder what failed.

A pull starts from the version's listing (directory.VersionDirectory.read_version). It picks
the holder with the fewest active pullers (ties go to relays, so the trainer's link is not the
bottleneck), asks it for every bucket still pending that it holds (a rank of a sharded trainer
group holds a share of each version) and receives them straight into the staging
buffer, IN_FLIGHT_BUCKETS receives posted ahead. A bucket counts only once its checksum matches
the manifest; a bad bucket is pulled again from another holder, and if the source dies, stalls
or leaves the holders mid-pull, the verified buckets are kept and the rest come from another
holder. A pull with no holder left waits for one (a relay still pulling, a trainer restarting)
until pull_timeout, or gives up at once when a newer manifest has replaced its version.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass

import torch

from robustrl.core.logs import get_logger
from robustrl.weights.checksums import LandedChecks
from robustrl.weights.protocol import (
    BAD_REPLY,
    BUSY,
    IN_FLIGHT_BUCKETS,
    ROLE_TRAINER,
    BucketManifest,
    HolderRecord,
    HolderRefused,
)
from robustrl.weights.transport import PullProgress
from robustrl.weights.ucx.buffers import bucket_view
from robustrl.weights.ucx.connections import Endpoints, HolderConnection, SourceGuard, SourceLeft
from robustrl.weights.ucx.counters import TransferCounters
from robustrl.weights.ucx.directory import VersionDirectory, WeightUnavailable

log = get_logger(__name__)


class KeptEndpointLost(Exception):
    """A holder hung up an endpoint a puller kept between pulls (it closed its transport, or
    ended the connection) before it answered: the pull asks that holder again on a new
    endpoint instead of counting it as failed. The endpoint is gone, so this happens at most
    once per holder in a row."""


@dataclass
class PullTimings:
    """Where one pull's time went, for its log line: reading the manifest and its holders,
    asking holders for buckets (connect, request, reply), receiving them, and waiting for
    checksums after the last one arrived. check_s is the part of receive_s the loop spent
    checking buckets as they landed (LandedChecks.landed: hashing a host bucket there and
    then, or queuing a GPU run's kernel); on a host the last bucket's hash is in it, not in
    verify_wait_s. first_s is the part of receive_s before the first bucket landed (from the
    holder's reply): the rest of receive_s is the stream of buckets."""

    manifest_s: float = 0.0
    request_s: float = 0.0
    receive_s: float = 0.0
    check_s: float = 0.0
    first_s: float = 0.0
    verify_wait_s: float = 0.0

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}


def choose_holder(holders: Sequence[HolderRecord], rng: random.Random) -> HolderRecord | None:
    """Fewest active pullers first; among equals a relay before the trainer; then at random,
    so pullers that start together spread over the relays."""
    open_ = [h for h in holders if not h.full]
    if not open_:
        return None

    def rank(h: HolderRecord) -> tuple[int, bool]:
        return (h.active_pullers, h.role == ROLE_TRAINER)

    best = min(rank(h) for h in open_)
    ties = sorted((h for h in open_ if rank(h) == best), key=lambda h: h.instance_id)
    return rng.choice(ties)


class Puller:
    """Pulls versions' buckets from their holders into a buffer, verified."""

    def __init__(
        self,
        directory: VersionDirectory,
        endpoints: Endpoints,
        *,
        counters: TransferCounters,
        pool: Executor,
        rng: random.Random,
        pull_timeout: float,
        stall_timeout: float,
        in_flight: int = IN_FLIGHT_BUCKETS,
    ) -> None:
        self._directory = directory
        self._endpoints = endpoints
        self._counters = counters
        self._pool = pool
        self._rng = rng
        self.pull_timeout = pull_timeout
        self.stall_timeout = stall_timeout
        self.in_flight = in_flight
        # What a failing source raises: timeouts, socket errors, leaving the holders (the
        # transport adds ucxx's errors once it has started).
        self.transfer_errors: tuple[type[BaseException], ...] = (TimeoutError, OSError, SourceLeft)

    async def pull_buckets(
        self,
        manifest: BucketManifest,
        manifest_revision: int,
        buffer: torch.Tensor,
        timings: PullTimings,
        progress: PullProgress,
        first_listing: tuple[list[HolderRecord], int] | None = None,
    ) -> None:
        """Fill `buffer` with every bucket of `manifest`, verified; WeightUnavailable if no
        holder can serve what is left (see the module docstring)."""
        counters = self._counters
        pending = set(range(len(manifest.buckets)))
        bad_from: dict[int, set[str]] = {}  # bucket -> holders that sent it corrupt
        excluded: set[str] = set()  # dead, hung or refusing holders, for this pull
        deadline = time.monotonic() + self.pull_timeout
        source: str | None = None  # the last holder that delivered buckets
        while pending:
            if first_listing is not None:
                (listed, revision), first_listing = first_listing, None
            else:
                listed, revision = await self._directory.list_holders(manifest)
            # A holder may hold a share of the version only (a rank of a sharded trainer).
            usable = [
                h
                for h in listed
                if h.instance_id not in excluded
                and any(h.holds(b) and h.instance_id not in bad_from.get(b, ()) for b in pending)
            ]
            choice = choose_holder(usable, self._rng)
            if choice is None:
                left_s = deadline - time.monotonic()
                stranded = not any(
                    h.instance_id not in excluded and any(h.holds(b) for b in pending)
                    for h in listed
                )
                why = (
                    await self._directory.superseded(manifest, manifest_revision)
                    if stranded
                    else None
                )
                if left_s <= 0 or why is not None:
                    raise WeightUnavailable(
                        f"version {manifest.version} of job {manifest.job_id}: "
                        f"{len(pending)} of {len(manifest.buckets)} buckets left and no holder "
                        f"can serve them (excluded: {sorted(excluded)})"
                        + (f"; given up because {why}" if why else "")
                    )
                # Holders are busy or not there yet (a relay still pulling, a trainer
                # restarting).
                await self._directory.wait_for_holders(
                    manifest, revision, min(left_s, 1.0), any_version=stranded
                )
                continue
            if source is not None and choice.instance_id != source:
                counters.source_switches += 1
                log.info(
                    "weights.source_switched",
                    version=manifest.version,
                    old=source,
                    new=choice.instance_id,
                    left=len(pending),
                )
            wanted = sorted(
                b
                for b in pending
                if choice.holds(b) and choice.instance_id not in bad_from.get(b, ())
            )
            left = len(pending)
            departures = self._directory.departures
            try:
                gone = departures.watch(manifest.version, choice.instance_id, revision)
                try:
                    await self._pull_from(
                        choice, manifest, buffer, wanted, pending, bad_from, timings, progress, gone
                    )
                finally:
                    departures.unwatch(manifest.version, choice.instance_id)
            except HolderRefused as exc:
                counters.refusals += 1
                if exc.code == BUSY:
                    # Its record lags its count: wait for the record (or another) to change.
                    await self._directory.wait_for_holders(manifest, revision, 1.0)
                else:
                    excluded.add(choice.instance_id)
                    log.info(
                        "weights.holder_refused",
                        version=manifest.version,
                        holder=choice.instance_id,
                        code=exc.code,
                        reason=exc.message,
                    )
            except KeptEndpointLost as exc:
                counters.kept_endpoints_lost += 1
                log.info(
                    "weights.kept_endpoint_lost",
                    version=manifest.version,
                    holder=choice.instance_id,
                    error=str(exc)[:200],
                )
            except self.transfer_errors as exc:
                counters.source_failures += 1
                excluded.add(choice.instance_id)
                log.warning(
                    "weights.source_failed",
                    version=manifest.version,
                    holder=choice.instance_id,
                    left=len(pending),
                    error=repr(exc)[:200],
                )
            if len(pending) < left:
                source = choice.instance_id

    async def _connect(self, holder: HolderRecord, gone: asyncio.Event) -> HolderConnection:
        """An endpoint to the holder, or SourceLeft once its record goes while connecting: a
        connect to a dead or frozen holder otherwise waits out the connect timeout (5 s) after
        the coordinator has already withdrawn the holder's records (a trainer just fenced)."""
        connecting = asyncio.ensure_future(self._endpoints.connect(holder.address))
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({connecting, left}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            connecting.cancel()
            raise
        finally:
            left.cancel()
        if not connecting.done():
            # Cancelled as a connect timeout would end it: the handshake's buffers stay kept
            # until UCX is done with them (progress.exchange_peer_info).
            connecting.cancel()
            await asyncio.wait({connecting})
            if not connecting.cancelled() and connecting.exception() is None:
                await connecting.result().close()  # connected as it was cancelled
            raise SourceLeft(f"holder {holder.instance_id} left the holders while connecting")
        return connecting.result()

    async def _pull_from(
        self,
        holder: HolderRecord,
        manifest: BucketManifest,
        buffer: torch.Tensor,
        wanted: list[int],
        pending: set[int],
        bad_from: dict[int, set[str]],
        timings: PullTimings,
        progress: PullProgress,
        gone: asyncio.Event,
    ) -> None:
        """Stream `wanted` from one holder, checking each bucket as it lands (LandedChecks).
        Verified buckets leave `pending` even if the holder fails later.

        A SourceGuard aborts the endpoint once `gone` is set (the holder's record was deleted)
        or after stall_timeout without a bucket; the pull then fails with SourceLeft or
        TimeoutError."""
        checks = LandedChecks(manifest.checksum_algorithm, self._pool)
        started = time.perf_counter()
        conn = await self._connect(holder, gone)
        guard = SourceGuard(
            conn, holder.instance_id, gone, self.stall_timeout, self.transfer_errors
        )
        completed = False
        try:
            async with guard:
                try:
                    seq, sizes = await conn.request(
                        manifest.job_id, manifest.version, manifest.digest, wanted
                    )
                except self.transfer_errors as exc:
                    if conn.parks and guard.why() is None:
                        raise KeptEndpointLost(repr(exc)) from exc
                    raise
                guard.progressed()
                timings.request_s += time.perf_counter() - started
                started = time.perf_counter()
                expected = [(i, manifest.buckets[i].nbytes) for i in wanted]
                if sizes != expected:
                    raise HolderRefused(BAD_REPLY, f"offered {sizes[:4]}..., asked {wanted[:4]}...")
                await receive_buckets(
                    conn,
                    guard,
                    manifest,
                    buffer,
                    seq,
                    sizes,
                    checks,
                    timings,
                    progress,
                    self.in_flight,
                )
                completed = True
        finally:
            timings.receive_s += time.perf_counter() - started
            started = time.perf_counter()
            if completed and guard.why() is None:
                await self._endpoints.park(conn)
            else:
                await conn.close()
            # Buckets that fully arrived count even when the source failed after them.
            for index, digest in await checks.results():
                bucket = manifest.buckets[index]
                if digest == bucket.checksum:
                    pending.discard(index)
                    self._counters.buckets_by_source[holder.instance_id] += 1
                    self._counters.bytes_by_source[holder.instance_id] += bucket.nbytes
                else:
                    self._counters.checksum_failures += 1
                    bad_from.setdefault(index, set()).add(holder.instance_id)
                    log.warning(
                        "weights.bucket_corrupt",
                        version=manifest.version,
                        bucket=index,
                        holder=holder.instance_id,
                    )
            timings.verify_wait_s += time.perf_counter() - started


async def receive_buckets(
    conn: HolderConnection,
    guard: SourceGuard,
    manifest: BucketManifest,
    buffer: torch.Tensor,
    seq: int,
    sizes: list[tuple[int, int]],
    checks: LandedChecks,
    timings: PullTimings,
    progress: PullProgress,
    in_flight: int = IN_FLIGHT_BUCKETS,
) -> None:
    """Receive the buckets of one request, in_flight posted ahead, handing each to
    `checks` as it lands and counting it in `progress`."""
    receives: collections.deque[tuple[int, torch.Tensor, asyncio.Future[None]]] = (
        collections.deque()
    )
    began = time.perf_counter()
    first = True

    async def verify_next() -> None:
        nonlocal first
        index, view, received = receives.popleft()
        await received
        guard.progressed()
        started = time.perf_counter()
        if first:
            timings.first_s += started - began
            first = False
        checks.landed(index, view)
        timings.check_s += time.perf_counter() - started
        progress.received(view.numel(), guard.holder)

    try:
        for index, _ in sizes:
            view = bucket_view(manifest, buffer, index)
            receives.append((index, view, asyncio.ensure_future(conn.receive(view, seq, index))))
            if len(receives) >= in_flight:
                await verify_next()
        while receives:
            await verify_next()
    finally:
        if receives:
            # Receives still posted into our buffer end with the endpoint (UCX fails them),
            # so waiting for them cannot outlast a frozen or dead source.
            await conn.close()
            await asyncio.gather(*(r for _, _, r in receives), return_exceptions=True)
