"""The UCX weight transport: versions split into verified buckets, served by every holder.

`UcxTransport` is the WeightTransport a trainer publishes with and a rollout pulls and relays
with. It composes the parts below, each with the narrow view of the others it needs; the wire
format and the records in etcd that they share are protocol.py.

    publisher.py    pack, checksum, and write the manifest with the announcement (trainer)
    directory.py    the job's versions in etcd: a watched view, holder listings, epochs, GC
    held.py         the versions this process holds, at most keep_versions
    records.py      this process's holder records in etcd, under its session's lease
    holder.py       serving pullers: a request checked against what is held, then buckets
    puller.py       choosing holders, pulling and verifying buckets, pulling again elsewhere
    connections.py  endpoints to holders: exchanges, a guard on each, endpoints kept between pulls
    buffers.py      the flat buffers versions live in: allocation, reuse, packing, views
    progress.py, listeners.py   how the event loop drives ucxx, and listeners that outlive us

A trainer publishes version V: pack, checksum, write the manifest, hold V and register as its
holder. A sharded trainer group publishes V as shares: every rank packs and checksums its own
range of buckets (publisher.VersionShare), rank 0 writes the manifest of all their checksums
(`publish_share`), and each rank holds its range once the manifest is there (`hold_share`); a
puller takes each range from the rank that holds it. A rollout pulls V from the holder with
the fewest pullers, verifies every bucket, and (relay=True) holds and serves V in turn. Pulls
reuse what the last pull set up: the endpoint to a holder stays open for the next pull from
it, and a receive buffer no tensor uses any more is received into again; a publisher packs
into the buffer of a version it has dropped.

UCX runs on CPU over TCP and shared memory; on GPU hosts buffers may live on the device (the
staging buffer is allocated on the pull's device and ucxx moves CUDA memory directly). A
version published from GPU memory carries wsum128 checksums, verified on the GPU, so its bytes
never pass through the host; only a GPU puller of a host-published version copies each bucket
back to hash it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import aetcd
import torch

from robustrl.contracts.errors import Fenced
from robustrl.contracts.keys import KeySpace, WeightKeys
from robustrl.core.logs import get_logger
from robustrl.weights.checksums import CHECKSUM_ALGORITHMS
from robustrl.weights.grpc_stream import GrpcStreamTransport
from robustrl.weights.protocol import (
    DEFAULT_BUCKET_BYTES,
    IN_FLIGHT_BUCKETS,
    ROLE_RELAY,
    ROLE_TRAINER,
    BucketManifest,
)
from robustrl.weights.transport import (
    PULL_PROGRESS_EVERY_S,
    Announcement,
    LocalSource,
    NamedTensors,
    PullProgress,
    WeightTransport,
)
from robustrl.weights.ucx import listeners as ucx_listeners
from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.buffers import HostBuffers, unpack_views
from robustrl.weights.ucx.connections import PARK_SECONDS, Endpoints
from robustrl.weights.ucx.counters import TransferCounters
from robustrl.weights.ucx.directory import VersionDirectory, WeightUnavailable
from robustrl.weights.ucx.held import HeldVersion, HeldVersions
from robustrl.weights.ucx.holder import HolderFaults, HolderServer
from robustrl.weights.ucx.lifetime import Lifetime
from robustrl.weights.ucx.publisher import Publisher, VersionShare
from robustrl.weights.ucx.puller import Puller, PullTimings
from robustrl.weights.ucx.records import PULLERS_RECORD_DELAY_S, HolderRecords

log = get_logger(__name__)

DEFAULT_KEEP_VERSIONS = 2
# Threads that hash what a publisher packs (and CUDA or wsum128 buckets a puller receives).
DEFAULT_HASH_THREADS = min(4, os.cpu_count() or 1)


class UcxUnavailable(RuntimeError):
    """UCX cannot start in this process (ucxx missing, no usable transport, listener failed)."""


# --------------------------------------------------------------------------- ucxx set-up


def _ucx_env_defaults() -> None:
    """UCX settings that must be in the environment before ucxx is imported. Anything already
    set by the operator wins (docs/decisions/0109).

    ucxx endpoints from a listener always use peer error handling (we need it: a killed holder
    must fail the pull, not hang it). UCX then only picks transports that report peer failure,
    which excludes shared memory unless its error handling is switched on; without it
    intra-host pulls fall back to TCP loopback. ucxx also defaults rendezvous fragments to
    CUDA memory, which a CPU-only host lacks.
    """
    os.environ.setdefault("UCX_POSIX_ERROR_HANDLING", "y")
    os.environ.setdefault("UCX_SYSV_ERROR_HANDLING", "y")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Between processes on one host UCX moves host memory by CMA (one copy: the receiver
    # reads the sender's pages with process_vm_readv) only if, with error handling on, the
    # transport can invalidate memory, which CMA claims only when told to; otherwise it
    # pipelines through shared memory, a copy on each side. Invalidation keeps a failed peer
    # from reaching into memory after the failure. Here no peer writes into a puller (the
    # puller reads), a holder never changes a bucket while serving it, and every bucket is
    # checksummed on arrival, so a read that races a failure is caught like any corruption.
    os.environ.setdefault("UCX_CMA_MEMORY_INVALIDATE", "y")
    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")


def warm_up_ucxx() -> None:
    """Import ucxx ahead (about half a second), from any thread, so that the transport's start
    does not pay for it. Initialising stays with `load_ucxx`, on the event loop."""
    _ucx_env_defaults()
    with contextlib.suppress(Exception):  # no ucxx here: make_transport reports it
        import ucxx  # noqa: F401


def load_ucxx(progress_mode: str | None = None) -> ModuleType:
    """Import and initialise ucxx once per process; UcxUnavailable if it cannot start.

    Progress defaults to 'blocking', driven by the event loop on the worker's epoll fd
    (docs/decisions/0109). ucxx's blocking mode spins once a message has come;
    `progress.install` mends it.
    """
    _ucx_env_defaults()
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a missing libucx underneath it
        raise UcxUnavailable(f"cannot import ucxx: {exc!r}") from exc
    mode = progress_mode or os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
    ucx_progress.install()  # before init: it makes the worker's progress task
    try:
        ucxx.init(progress_mode=mode)
    except RuntimeError:
        pass  # already initialised in this process (another transport or library did it)
    except Exception as exc:
        raise UcxUnavailable(f"ucxx.init failed: {exc!r}") from exc
    return ucxx


def _pull_thread_default() -> bool:
    """Whether pulls use a worker of their own, progressed by its own thread (progress.
    pull_context): on hosts without CUDA, unless ROBUSTRL_UCX_PULL_THREAD=0
    (docs/decisions/0104)."""
    return os.environ.get("ROBUSTRL_UCX_PULL_THREAD", "1") != "0" and not torch.cuda.is_available()


def _ucx_errors(ucxx: ModuleType) -> tuple[type[BaseException], ...]:
    canceled: type[BaseException] = ucxx.exceptions.UCXCanceledError
    return (canceled.__mro__[1], ucxx.exceptions.UCXError)


# --------------------------------------------------------------------------- the transport


class UcxTransport(WeightTransport):
    """Publish (trainer), pull, and relay weight versions over UCX; see the module docstring.

    Call `await start()` before anything else and `await close()` at the end. `make_transport`
    does the start and falls back to gRPC when UCX cannot run.
    """

    name = "ucx"

    def __init__(
        self,
        client: aetcd.Client,
        keys: KeySpace,
        job_id: str,
        *,
        instance_id: str,
        epoch: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keep_versions: int = DEFAULT_KEEP_VERSIONS,
        relay: bool = True,
        max_pullers: int = 0,
        session_ttl: int = 5,
        pull_timeout: float = 120.0,
        stall_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        hash_threads: int | None = None,
        checksum_algorithm: str | None = None,
        progress_mode: str | None = None,
        pull_thread: bool | None = None,
        record_delay: float = PULLERS_RECORD_DELAY_S,
        park_seconds: float = PARK_SECONDS,
        progress_every_s: float = PULL_PROGRESS_EVERY_S,
        in_flight: int = IN_FLIGHT_BUCKETS,
        faults: HolderFaults | None = None,
        seed: int | None = None,
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be at least 1")
        if checksum_algorithm not in (None, *CHECKSUM_ALGORITHMS):
            raise ValueError(f"checksum_algorithm must be one of {CHECKSUM_ALGORITHMS}")
        self.client = client
        self.keys = keys
        self.job_id = job_id
        self.instance_id = instance_id
        self.epoch = epoch
        self.host = host
        self.port = port
        self.relay = relay
        self.progress_mode = progress_mode
        self.pull_thread = _pull_thread_default() if pull_thread is None else pull_thread
        self.progress_every_s = progress_every_s
        self.counters = TransferCounters()
        self.last_pull: PullTimings | None = None  # where the last completed pull's time went
        self.lifetime = Lifetime()
        self._pool = ThreadPoolExecutor(
            max_workers=hash_threads or DEFAULT_HASH_THREADS,
            thread_name_prefix="ucx-weights-hash",
        )
        self._ucxx: ModuleType | None = None
        self._listening: ucx_listeners.ListeningPort | None = None
        self._grpc: GrpcStreamTransport | None = None
        # A relay holds at most keep_versions versions, the one it pulls included (it drops
        # the oldest before it pulls: HeldVersions.make_room); a non-relay one buffer.
        self._buffers = HostBuffers(keep_versions if relay else 1)
        wkeys = WeightKeys(keys)
        counters, lifetime = self.counters, self.lifetime
        self.directory = VersionDirectory(
            client, wkeys, job_id, instance_id=instance_id, counters=counters
        )
        self.held = HeldVersions(keep_versions, job_id)
        self.records = HolderRecords(
            client,
            wkeys,
            job_id,
            instance_id=instance_id,
            held=self.held,
            directory=self.directory,
            counters=counters,
            lifetime=lifetime,
            max_pullers=max_pullers,
            record_delay=record_delay,
            session_ttl=session_ttl,
        )
        self.held.on_drop = self.records.forget  # a dropped copy's record goes too
        self.publisher = Publisher(
            client,
            wkeys,
            job_id,
            epoch=epoch,
            bucket_bytes=bucket_bytes,
            checksum_algorithm=checksum_algorithm,
            pool=self._pool,
            # What publish and hold pack into: the versions held, and the one being packed.
            packs=HostBuffers(keep_versions + 1),
        )
        self.server = HolderServer(
            self.held,
            job_id=job_id,
            instance_id=instance_id,
            max_pullers=max_pullers,
            counters=counters,
            lifetime=lifetime,
            pullers_changed=self.records.pullers_changed,
            faults=faults or HolderFaults(),
            in_flight=in_flight,
        )
        self.endpoints = Endpoints(
            self.endpoints_for_pulls,
            connect_timeout=connect_timeout,
            park_seconds=park_seconds,
            counters=counters,
            lifetime=lifetime,
        )
        self.puller = Puller(
            self.directory,
            self.endpoints,
            counters=counters,
            pool=self._pool,
            rng=random.Random(instance_id if seed is None else seed),
            pull_timeout=pull_timeout,
            stall_timeout=stall_timeout,
            in_flight=in_flight,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """host:port of this process's UCX listener (valid after start)."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Start the UCX listener and the etcd session holders register under."""
        self._ucxx = load_ucxx(self.progress_mode)
        # What a failing source or puller raises, ucxx's errors included.
        self.puller.transfer_errors += _ucx_errors(self._ucxx)
        self.server.transfer_errors = self.puller.transfer_errors
        try:
            self._listening = ucx_listeners.borrow(self._ucxx, self.server.serve, self.port)
        except Exception as exc:
            raise UcxUnavailable(f"UCX listener failed: {exc!r}") from exc
        self.port = self._listening.port
        await self.records.open(self.address)
        job = self.job_id
        self.lifetime.start(
            self.records.keep_session(), f"ucx-weights-session-{job}", until_closed=True
        )
        self.lifetime.start(
            self.directory.watch(self.records), f"ucx-weights-gc-{job}", until_closed=True
        )
        log.info("weights.ucx_started", job=job, address=self.address)

    async def close(self) -> None:
        """Stop serving, drop held buffers, revoke the lease (holder keys go at once)."""
        if self.lifetime.closed:
            return
        await self.lifetime.end()
        await self.server.close()
        await self.endpoints.close()
        if self._listening is not None:
            ucx_listeners.give_back(self._listening)  # never closed: see listeners.py
            self._listening = None
        self.held.clear()
        self._buffers.clear()
        self.publisher.packs.clear()
        await self.records.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def held_versions(self) -> list[int]:
        return self.held.versions()

    def local_source(self, version: int) -> LocalSource | None:
        held = self.held.get(version)
        if held is None or not held.whole:
            return None
        return LocalSource(version, self.address, held.manifest.to_json())

    def listed_versions(self) -> dict[int, list[str]]:
        """Versions whose manifest this transport's watch has delivered, with their holders: a
        pull of one of them starts without reading etcd."""
        return self.directory.view.versions()

    def gauges(self) -> dict[str, float]:
        held = {"weights_versions_held": float(len(self.held))}
        return {**super().gauges(), **self.counters.gauges(), **held}

    def endpoints_for_pulls(self) -> Any:
        """What makes a puller's endpoints: with pull_thread, the worker of ours that a thread
        progresses (progress.pull_context), so UCX copies beside our checksums; else the
        process's worker, which serves as holder too."""
        assert self._ucxx is not None
        if self.pull_thread and self._ucxx.core._get_ctx().progress_mode == "blocking":
            return ucx_progress.pull_context(self._ucxx)
        return self._ucxx

    # ------------------------------------------------------------------ publish / hold

    async def publish(self, version: int, tensors: NamedTensors) -> None:
        """Trainer: pack, hash, write the manifest (fenced by epoch), hold, announce, GC.

        Fenced if a newer trainer epoch already published this version or announced.
        """
        started = time.perf_counter()
        manifest, buffer = await self.publisher.pack(version, tensors)
        await self._publish(manifest, buffer, 0, len(manifest.buckets), started)

    def take_buffer(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A buffer to pack a share into: a host buffer of a version dropped, if one fits."""
        return self.publisher.packs.take(nbytes, device)

    async def publish_share(self, version: int, share: VersionShare) -> None:
        """Rank 0 of a sharded trainer group: write the manifest of `version` with every
        rank's checksums (fenced by epoch, as `publish`), then hold this rank's share. The
        other ranks hold theirs once they see the manifest (`hold_share`)."""
        started = time.perf_counter()
        manifest = share.manifest(self.job_id, version, self.epoch)
        await self._publish(manifest, share.buffer, share.first, share.stop, started)

    async def _publish(
        self, manifest: BucketManifest, buffer: torch.Tensor, first: int, stop: int, started: float
    ) -> None:
        """Write the manifest and announcement, hold buckets [first, stop) of it from
        `buffer`, and collect the versions no longer kept."""
        revision = await self.publisher.write(manifest, self.address, self.name)
        self.directory.saw_epoch(self.epoch)
        await self._hold_trainer_copy(manifest, buffer, revision, first, stop)
        await self.directory.collect_garbage(manifest.version, self.held.keep)
        log.info(
            "weights.published",
            job=self.job_id,
            version=manifest.version,
            bytes=manifest.total_bytes,
            tensor_bytes=sum(t.nbytes for t in manifest.tensors),
            dtypes=",".join(sorted({t.dtype for t in manifest.tensors})),
            buckets=len(manifest.buckets),
            held=[first, stop],
            epoch=self.epoch,
            seconds=round(time.perf_counter() - started, 6),
        )

    async def hold_share(self, version: int, share: VersionShare, timeout: float) -> None:
        """A rank > 0 of a sharded trainer group: hold this rank's share of `version` once rank
        0 has written its manifest at this epoch with these contents. Fenced if a newer epoch
        wrote it; WeightUnavailable if it is not there within `timeout`."""
        expected = share.manifest(self.job_id, version, self.epoch).digest
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            now = await self.directory.manifest_now(version)
            if now is not None:
                manifest = self.directory.manifest(now[0])
                if manifest.trainer_epoch > self.epoch:
                    raise Fenced(
                        f"job {self.job_id}: trainer epoch {manifest.trainer_epoch} published "
                        f"version {version}; this rank has epoch {self.epoch}"
                    )
                if (manifest.digest, manifest.trainer_epoch) == (expected, self.epoch):
                    self.directory.saw_epoch(self.epoch)
                    await self._hold_trainer_copy(
                        manifest, share.buffer, now[1], share.first, share.stop
                    )
                    return
            if time.monotonic() >= deadline:
                raise WeightUnavailable(
                    f"version {version} of job {self.job_id}: rank 0 wrote no manifest of this "
                    f"rank's contents at epoch {self.epoch} within {timeout:.0f} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _hold_trainer_copy(
        self, manifest: BucketManifest, buffer: torch.Tensor, revision: int, first: int, stop: int
    ) -> None:
        """Hold and register buckets [first, stop) of a version this trainer (rank) packed."""
        whole = (first, stop) == (0, len(manifest.buckets))
        if whole or stop > first:  # a rank with no bucket of a small version holds none
            held = HeldVersion(
                manifest,
                buffer,
                ROLE_TRAINER,
                revision,
                first_bucket=first,
                stop_bucket=None if whole else stop,
            )
            self.held.add(manifest.version, held)
            await self.records.register(manifest.version)
        self.held.prune()

    async def hold(self, version: int, tensors: NamedTensors) -> None:
        """Relay: serve `version` from these tensors (already verified) to other pullers.

        A version this transport pulled is held already (when relay=True) and costs nothing
        here. Otherwise the tensors are packed against the published manifest and must match
        it bucket for bucket (WeightIntegrityError if not).
        """
        if version in self.held:
            return
        manifest, revision, _ = await self.directory.read_version(version)
        buffer = await self.publisher.pack_matching(manifest, tensors)
        self.held.add(version, HeldVersion(manifest, buffer, ROLE_RELAY, revision))
        await self.records.register(version)
        self.held.prune()

    # ------------------------------------------------------------------ pull

    async def fetch(self, announcement: Announcement) -> NamedTensors:
        """Pull the announced version (the existing Announcement flow).

        An announcement from a trainer that fell back to gRPC is fetched over gRPC.
        """
        if announcement.transport != self.name:
            if self._grpc is None:
                self._grpc = GrpcStreamTransport(
                    self.client, self.keys, self.job_id, address="", epoch=0
                )
            return await self._grpc.fetch(announcement)
        self.directory.saw_epoch(announcement.trainer_epoch)
        return await self.pull(announcement.job_id, announcement.version)

    async def latest_version(self) -> int | None:
        """The newest version whose manifest comes from the highest trainer epoch seen."""
        return await self.directory.latest_version()

    async def pull(
        self, job_id: str, version: int, *, device: torch.device | str = "cpu"
    ) -> NamedTensors:
        """Pull `version` from its holders, verify every bucket, return the tensors.

        The tensors are views of one buffer this transport keeps while it relays the version
        (relay=True); treat them as read-only (copy them into the model). A later pull receives
        into that buffer again only once none of them is left. WeightUnavailable if no holder
        can complete the pull within pull_timeout, or at once when every holder is gone and a
        newer manifest has replaced this one (directory.VersionDirectory.superseded).
        """
        if job_id != self.job_id:
            raise ValueError(f"this transport serves job {self.job_id}, not {job_id}")
        held = self.held.get(version)
        if held is not None and held.manifest.trainer_epoch < self.directory.highest_epoch:
            held = await self.records.current(held)
        if held is not None and held.whole:
            return unpack_views(held.manifest, held.buffer)
        started = time.perf_counter()
        # The manifest and the holders listed with it, from the watch's view or one read.
        manifest, revision, holders = await self.directory.read_version(version)
        timings = PullTimings(manifest_s=time.perf_counter() - started)
        if self.relay:
            self.held.make_room()
        buffer = self._buffers.take(manifest.total_bytes, device)
        progress = self.pulling = PullProgress(version, manifest.total_bytes, self.progress_every_s)
        try:
            with ucx_progress.pulling():
                await self.puller.pull_buckets(
                    manifest, revision, buffer, timings, progress, holders
                )
        finally:
            if self.pulling is progress:
                self.pulling = None
        self.counters.pulls_completed += 1
        self.last_pull = timings
        if self.relay and not self.lifetime.closed:
            self.held.add(version, HeldVersion(manifest, buffer, ROLE_RELAY, revision))
            # Registered in the background: the caller has its tensors without waiting for an
            # etcd write, and a failed write is retried when the session keeper re-registers.
            self.records.schedule(version)
            self.held.prune()
        log.info(
            "weights.pulled",
            job=job_id,
            version=version,
            bytes=manifest.total_bytes,
            device=buffer.device.type,
            checksum=manifest.checksum_algorithm,
            seconds=round(time.perf_counter() - started, 6),
            **timings.rounded(),
            sources=dict(self.counters.buckets_by_source),
        )
        return unpack_views(manifest, buffer)


# --------------------------------------------------------------------------- factory


async def make_transport(
    kind: str,
    client: aetcd.Client,
    keys: KeySpace,
    job_id: str,
    *,
    instance_id: str,
    epoch: int = 0,
    grpc_address: str = "",
    **ucx_options: Any,
) -> WeightTransport:
    """The weight transport to use: UCX (started), or gRPC when asked or when UCX cannot start.

    kind: "ucx" or "grpc". grpc_address: this process's gRPC address (the trainer's, where
    PullWeights is served; rollouts pass ""). ucx_options go to UcxTransport (host, port,
    bucket_bytes, keep_versions, relay, max_pullers, ...).
    """
    if kind not in ("ucx", "grpc"):
        raise ValueError(f"weight transport kind must be 'ucx' or 'grpc', not {kind!r}")
    if kind == "ucx":
        transport = UcxTransport(
            client, keys, job_id, instance_id=instance_id, epoch=epoch, **ucx_options
        )
        try:
            await transport.start()
            return transport
        except UcxUnavailable as exc:
            log.warning("weights.ucx_unavailable", job=job_id, reason=str(exc)[:300])
            await transport.close()
        except BaseException:
            await transport.close()  # e.g. etcd unreachable: do not leave a listener behind
            raise
    return GrpcStreamTransport(client, keys, job_id, address=grpc_address, epoch=epoch)
