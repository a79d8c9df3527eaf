"""The UCX weight plane: versions split into verified buckets, served by every holder.

The trainer publishes version V: it packs the tensors into one buffer (64-byte aligned, in
manifest order), cuts the buffer into buckets (32 MiB by default), checksums each bucket
(xxh3-128 on the host, a weighted word sum on a GPU: see checksums.py), and writes the
manifest to etcd. Every process that holds V (the trainer after publishing, a rollout after it
pulled and verified V) runs a UCX listener and registers as a holder under its own etcd lease,
so a dead holder drops out with its lease:

    <prefix>/weights/<job_id>                                Announcement (existing flow)
    <prefix>/weights/<job_id>/v/<V:012d>/manifest            BucketManifest (JSON), no lease
    <prefix>/weights/<job_id>/v/<V:012d>/holders/<instance>  HolderRecord (JSON), holder's lease

A puller reads the manifest, picks the holder with the fewest active pullers (ties go to
relays, so the trainer's link is not the bottleneck), and pulls bucket by bucket straight into
one staging buffer. A bucket is used only if its checksum matches the manifest; a bad bucket
is pulled again from another holder, and if the source dies mid-pull the verified buckets are
kept and the rest come from another holder. A manifest from an older trainer epoch than the
highest seen is never pulled (a fenced trainer's late publish).

The checksums guard against corruption: flipped bits, torn or misplaced transfers, a holder
serving a broken copy. They are not a defence against an adversary: neither algorithm is
collision resistant, and the manifest comes from etcd unsigned anyway (whoever can write etcd
or pose as a holder is trusted already). xxh3 verifies at ~30 GB/s a core here, sha256 at
~1.7, which capped a pull at the checksum's speed.

Pulls reuse what the last pull set up: the endpoint to a holder stays open for the next pull
from it, and a receive buffer no tensor uses any more is received into again (a fresh one
pays its page faults inside the transfer). A publisher packs into the buffer of a version it
has dropped, the same way. See HostBuffers for why that is safe.

Wire protocol (per UCX endpoint, puller -> holder): a JSON request (the version, its manifest's
digest, the buckets wanted as [start, stop) ranges), a JSON reply (ok with the bucket count and
the layout's bucket and total bytes, or an explicit error code and message), then on ok one
tagged message per bucket. Requests and replies are framed by ucx_progress.send_message: one
UCX message each, however many buckets a version has (ucxx's send_obj took two, and a reply that
listed every bucket's size outgrew the 64 KiB control limit at ~4,000 buckets, a 70B model in
32 MiB buckets). The holder never sends bytes it was not asked for and never answers a version
or bucket it does not hold with anything but an error reply.

UCX runs on CPU over TCP and shared memory; on GPU hosts buffers may live on the device (the
staging buffer is allocated on the pull's device and ucxx moves CUDA memory directly). A
version published from GPU memory carries wsum128 checksums, verified on the GPU, so its
bytes never pass through the host; only a GPU puller of a host-published version copies each
bucket back to hash it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import json
import os
import random
import time
import weakref
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import aetcd
import numpy as np
import torch

from robustrl.contracts.errors import Aborted, Fenced
from robustrl.contracts.keys import KeySpace, WeightKeys
from robustrl.core.logs import get_logger
from robustrl.core.session import Session, lease_gone
from robustrl.core.watch import (
    Delete,
    Entry,
    Put,
    Resync,
    list_prefix,
    next_change,
    watch_prefix,
)
from robustrl.weights.checksums import (
    CHECKSUM_ALGORITHMS,
    XXH3_128,
    LandedChecks,
    algorithm_for,
    bucket_checksum,
)
from robustrl.weights.transport import (
    PULL_PROGRESS_EVERY_S,
    Announcement,
    GrpcStreamTransport,
    NamedTensors,
    PullProgress,
    WeightIntegrityError,
    WeightTransport,
)
from robustrl.weights.ucx import listeners as ucx_listeners
from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.listeners import ABORT_NS

log = get_logger(__name__)

DEFAULT_BUCKET_BYTES = 32 << 20
DEFAULT_KEEP_VERSIONS = 2
# Threads that hash what a publisher packs (and CUDA or wsum128 buckets a puller receives).
DEFAULT_HASH_THREADS = min(4, os.cpu_count() or 1)
# Buckets posted ahead on one endpoint (sends on the holder, receives on the puller), so one
# bucket's completion never waits for the event loop to post the next: on an H100, receiving
# one 32 MiB bucket at a time reached a fifth of what the same copies do back to back.
IN_FLIGHT_BUCKETS = 4
# How long a holder waits before writing a change in its pullers count to its etcd record; every
# change in that time takes one write, and none if the count is back where the record has it.
# Writing at each request's start and end cost a puller 5-20% of a 64-256 MiB pull on 2 cores
# (the holder's transaction, etcd, and the puller's watch all ran while the bytes moved).
PULLERS_RECORD_DELAY_S = 0.05
ALIGN_BYTES = 64  # every tensor starts aligned, so views of the buffer are valid for any dtype
MAX_CONTROL_BYTES = 1 << 20  # requests and replies are small JSON; refuse anything bigger
MAX_IDLE_CONNECTIONS = 4  # endpoints kept open between pulls, to the holders used last
PARK_SECONDS = 2.0
"""How long a puller keeps an endpoint it does not use: a job that pulls every step keeps its
endpoints, an idle one gives its holders theirs back. A kept endpoint costs the holder nothing
while it waits (ucx_progress.receive_message)."""
PROTOCOL_VERSION = 2
MAX_MANIFEST_BYTES = 1 << 20
"""Bytes of a manifest a trainer writes: etcd takes requests of up to 1.5 MiB by default
(--max-request-bytes), and the manifest's transaction carries the announcement too: about
28,000 buckets (0.9 TB in 32 MiB buckets) beside 1,000 tensors. Before a bucket was only its
checksum there, 24,000 buckets took 2.5 MB."""
PARSED_MANIFESTS = 8
"""Manifests a transport keeps parsed (UcxTransport._manifest): parsing one of 3,000 tensors
took 6 ms here, and a pull, the watch and the checks of a stranded pull each want it."""

ROLE_TRAINER = "trainer"
ROLE_RELAY = "relay"


# --------------------------------------------------------------------------- errors


class WeightUnavailable(WeightIntegrityError):
    """The version cannot be pulled now: no manifest, stale epoch, or no holder could serve it.

    A WeightIntegrityError so existing callers that retry on integrity errors (and never load
    what failed) handle it without change.
    """


class ManifestTooLarge(ValueError):
    """A version whose manifest etcd cannot take in one write: too many buckets."""


class HolderRefused(Exception):
    """A holder answered a request with an explicit error (protocol level, not transport)."""

    def __init__(self, code: str, message: str, held: Sequence[int] = ()) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.held = list(held)


class SourceLeft(Exception):
    """The holder a pull was receiving from deleted its record: its lease expired, it closed,
    or the coordinator fenced it. A stopped (SIGSTOP) holder would otherwise be waited on
    until the stall timeout."""


class KeptEndpointLost(Exception):
    """A holder hung up an endpoint a puller kept between pulls (it closed its transport, or
    ended the connection) before it answered: the pull asks that holder again on a new
    endpoint instead of counting it as failed. The endpoint is gone, so this happens at most
    once per holder in a row."""


class UcxUnavailable(RuntimeError):
    """UCX cannot start in this process (ucxx missing, no usable transport, listener failed)."""


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketEntry:
    index: int
    offset: int
    nbytes: int
    checksum: str  # hex, of the manifest's checksum_algorithm


@dataclass(frozen=True)
class BucketManifest:
    """What version V holds and how it is cut into buckets; the puller verifies against it."""

    job_id: str
    version: int
    trainer_epoch: int
    total_bytes: int
    bucket_bytes: int
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[BucketEntry, ...]
    published_at: float = 0.0
    checksum_algorithm: str = XXH3_128

    @functools.cached_property
    def digest(self) -> str:
        """Identity of the contents: equal digests mean bitwise-equal buffers. Made once per
        manifest: a pull compares it with every holder's record, and for 339 tensors in 477
        buckets it took 0.28 ms here."""
        return manifest_digest(self.checksum_algorithm, self.tensors, self.buckets)

    def to_json(self) -> bytes:
        """The manifest as etcd keeps it: a tensor a row, a bucket its checksum (a bucket's
        place follows from bucket_bytes), so that a version of 24,000 buckets (810 GB in 32
        MiB buckets) fits in one etcd write (`manifest_for_etcd`)."""
        body = {
            "job_id": self.job_id,
            "version": self.version,
            "trainer_epoch": self.trainer_epoch,
            "total_bytes": self.total_bytes,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[t.name, t.dtype, t.shape, t.offset, t.nbytes] for t in self.tensors],
            "checksums": [b.checksum for b in self.buckets],
            "published_at": self.published_at,
            "checksum_algorithm": self.checksum_algorithm,
            "digest": self.digest,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> BucketManifest:
        """The manifest in raw; WeightIntegrityError for anything that is not one this
        process can verify (unreadable, a field missing or of the wrong type, a checksum count
        that does not cut total_bytes into bucket_bytes, an unknown checksum algorithm, a
        digest that does not match its contents)."""
        try:
            body = json.loads(raw)
            algorithm = body.get("checksum_algorithm")
            size, total = int(body["bucket_bytes"]), int(body["total_bytes"])
            checksums = body["checksums"]
            if size <= 0 or not isinstance(checksums, list) or len(checksums) != -(-total // size):
                raise ValueError(f"{len(checksums)} checksums for {total} bytes in {size}")
            manifest = cls(
                job_id=str(body["job_id"]),
                version=int(body["version"]),
                trainer_epoch=int(body["trainer_epoch"]),
                total_bytes=total,
                bucket_bytes=size,
                tensors=tuple(
                    TensorEntry(
                        str(name),
                        str(dtype),
                        tuple(map(int, shape)),
                        int(offset),
                        int(nbytes),
                    )
                    for name, dtype, shape, offset, nbytes in body["tensors"]
                ),
                buckets=tuple(
                    BucketEntry(i, i * size, bucket_nbytes(i, size, total), _checksum(c))
                    for i, c in enumerate(checksums)
                ),
                published_at=float(body.get("published_at", 0.0)),
                checksum_algorithm=str(algorithm),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightIntegrityError(f"unreadable weight manifest: {exc!r}"[:300]) from exc
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise WeightIntegrityError(
                f"version {manifest.version}: its buckets carry {algorithm or 'no'} "
                f"checksums and this process verifies {' and '.join(CHECKSUM_ALGORITHMS)} only: "
                "are the trainer and this process on different robustrl releases?"
            )
        if body.get("digest") not in (None, manifest.digest):
            raise WeightIntegrityError(f"version {manifest.version}: manifest digest mismatch")
        _check_tensors(manifest)
        return manifest


def _checksum(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a bucket checksum is a hex string, not {value!r}"[:100])
    return value


def _epoch_of(raw: bytes) -> int:
    """The trainer epoch of a manifest a publish would replace. One this release cannot read
    (an older release's format, left in etcd across an upgrade) is replaced: the announcement,
    written in the same transaction, still fences an older trainer."""
    try:
        return BucketManifest.from_json(raw).trainer_epoch
    except WeightIntegrityError as exc:
        log.warning("weights.manifest_replaced_unread", error=str(exc)[:200])
        return 0


def manifest_for_etcd(manifest: BucketManifest) -> bytes:
    """manifest.to_json(), or ManifestTooLarge if one etcd write could not carry it."""
    raw = manifest.to_json()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestTooLarge(
            f"version {manifest.version}: its manifest takes {len(raw)} bytes, over the "
            f"{MAX_MANIFEST_BYTES} one etcd write may carry here ({len(manifest.buckets)} "
            f"buckets of {manifest.bucket_bytes >> 20} MiB, {len(manifest.tensors)} tensors): "
            "raise trainer.weight_bucket_mib"
        )
    return raw


def manifest_digest(
    checksum_algorithm: str, tensors: Sequence[TensorEntry], buckets: Sequence[BucketEntry]
) -> str:
    # sha256 here costs nothing (the manifest is small) and names the contents unambiguously.
    hasher = hashlib.sha256(f"checksum|{checksum_algorithm}\n".encode())
    for t in tensors:
        hasher.update(f"{t.name}|{t.dtype}|{list(t.shape)}|{t.offset}|{t.nbytes}\n".encode())
    for b in buckets:
        hasher.update(f"{b.index}|{b.offset}|{b.nbytes}|{b.checksum}\n".encode())
    return hasher.hexdigest()


def bucket_nbytes(index: int, bucket_bytes: int, total_bytes: int) -> int:
    """The size of bucket `index` of a buffer cut into buckets of bucket_bytes (the last may be
    shorter; 0 past the end): pullers and holders derive the layout from these two numbers."""
    return max(0, min(bucket_bytes, total_bytes - index * bucket_bytes))


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_layout(
    tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[tuple[TensorEntry, ...], int, list[tuple[int, int]]]:
    """Tensor offsets in the packed buffer, its size, and the (offset, nbytes) of each bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    entries: list[TensorEntry] = []
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        offset = _align(offset)
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(TensorEntry(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    total = offset
    count = -(-total // bucket_bytes)
    spans = [(i * bucket_bytes, bucket_nbytes(i, bucket_bytes, total)) for i in range(count)]
    return tuple(entries), total, spans


def pack_into(
    tensors: Sequence[tuple[str, torch.Tensor]],
    entries: Sequence[TensorEntry],
    buffer: torch.Tensor,
) -> None:
    """Copy each tensor's bytes to its offset in buffer (any device; one copy, no host hop)
    and zero the alignment gaps, so every byte is set whatever the buffer held before: the
    bucket checksums cover the gaps, and a relay packing the same tensors must match them."""
    end = 0
    for (name, tensor), entry in zip(tensors, entries, strict=True):
        if name != entry.name:
            raise ValueError(f"tensor {name!r} where the layout has {entry.name!r}")
        if entry.offset > end:
            buffer[end : entry.offset].zero_()
        end = entry.offset + entry.nbytes
        if entry.nbytes == 0:
            continue
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[entry.offset : end].copy_(flat)
    if buffer.numel() > end:
        buffer[end:].zero_()


def unpack_views(manifest: BucketManifest, buffer: torch.Tensor) -> NamedTensors:
    """The tensors as views of the verified buffer (no copy: the buffer is the model copy).

    One as_strided a tensor, on a view of the whole buffer as its dtype. A slice, a view and a
    reshape a tensor took 0.72 ms for the 290 tensors of a Qwen2.5-0.5B-shaped model, on every
    pull's path; this takes 0.33 (medians of 9 runs side by side, 2 cores). The entries were
    checked against the buffer's size when the manifest was read (`_check_tensors`)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: NamedTensors = []
    for entry in manifest.tensors:
        dtype = _dtype(entry)
        whole = typed.get(dtype)
        if whole is None:
            usable = buffer.numel() // dtype.itemsize * dtype.itemsize
            whole = typed[dtype] = buffer[:usable].view(dtype)
        strides = _contiguous_strides(entry.shape)
        out.append(
            (entry.name, whole.as_strided(entry.shape, strides, entry.offset // dtype.itemsize))
        )
    return out


def _dtype(entry: TensorEntry) -> torch.dtype:
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightIntegrityError(f"{entry.name}: unknown dtype {entry.dtype!r}")
    return dtype


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _check_tensors(manifest: BucketManifest) -> None:
    """WeightIntegrityError unless every tensor is a known dtype whose bytes lie whole, and
    aligned to its element, within total_bytes (unpack_views relies on it)."""
    for entry in manifest.tensors:
        dtype = _dtype(entry)
        numel = 1
        for size in entry.shape:
            numel *= size
        if (
            min(entry.shape, default=0) < 0
            or entry.nbytes != numel * dtype.itemsize
            or entry.offset < 0
            or entry.offset % dtype.itemsize
            or entry.offset + entry.nbytes > manifest.total_bytes
        ):
            raise WeightIntegrityError(
                f"version {manifest.version}: tensor {entry.name} {entry.dtype}{list(entry.shape)}"
                f" does not lie in bytes {entry.offset}..{entry.offset + entry.nbytes} of "
                f"{manifest.total_bytes}"
            )


def allocate_buffer(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat byte buffer: one model copy.

    Host buffers come from numpy: UCX received into a fresh torch-allocated buffer at a
    quarter of the speed of a fresh numpy one here (1.0-1.6 against 3.8-7.4 GB/s over shared
    memory, same bytes). Its contents are arbitrary: pack_into and the buckets set every byte.
    """
    if torch.device(device).type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


class HostBuffers:
    """Host buffers that pulls receive into and publishers pack into, each used again once no
    tensor refers to it.

    A fresh buffer's pages are faulted in and zero-filled by the kernel while it is first
    written, on the core that writes: at 256 MiB a receive took 38-58 ms into a fresh buffer
    against 31-36 ms into a reused one here, and 300-600 ms when the kernel had to find the
    memory first. Packing 1 GiB took 0.10-1.65 s into a fresh buffer against 0.07 s into a
    reused one, and a trainer's step waits for its publish.
    A buffer is handed out again only when every tensor made from it is gone (the version it
    held was dropped, the caller let go of the pulled tensors, UCX finished with it): torch
    wraps a numpy view of the pages, and a weak reference to that view dies with the last
    tensor. So a caller can never see its tensors change under it.

    At most `keep` buffers are remembered, in use or not; pulls and publishes never hold more
    memory than without reuse (the held versions and the one being filled; a relay drops a
    held version before it pulls, see UcxTransport._make_room), only keep it between them.
    CUDA buffers are not kept: torch's caching allocator already reuses device memory.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._known: list[tuple[np.ndarray, weakref.ref[np.ndarray]]] = []

    def take(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A buffer of nbytes with arbitrary contents (every byte is received or packed over)."""
        if torch.device(device).type != "cpu":
            return allocate_buffer(nbytes, device)
        free = [entry for entry in self._known if entry[1]() is None]
        reuse = next((pages for pages, _ in free if pages.nbytes == nbytes), None)
        # Free buffers of another size (the layout changed) would only hold memory.
        self._known = [entry for entry in self._known if entry[1]() is not None]
        pages = reuse if reuse is not None else np.empty(nbytes, dtype=np.uint8)
        handle = pages.view()
        self._known = [*self._known, (pages, weakref.ref(handle))][-self.keep :]
        return torch.from_numpy(handle)

    def clear(self) -> None:
        self._known = []


# --------------------------------------------------------------------------- holders


@dataclass(frozen=True)
class HolderRecord:
    """A process serving a version over UCX, as registered in etcd under its lease."""

    instance_id: str
    address: str  # host:port of its UCX listener
    role: str  # ROLE_TRAINER or ROLE_RELAY
    trainer_epoch: int
    digest: str  # manifest digest of what it holds
    active_pullers: int = 0
    max_pullers: int = 0  # 0: no limit

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> HolderRecord:
        return cls(**json.loads(raw))

    @property
    def full(self) -> bool:
        return self.max_pullers > 0 and self.active_pullers >= self.max_pullers


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


# --------------------------------------------------------------------------- counters


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


@dataclass
class TransferCounters:
    """What this process pulled and served; counts, never timings."""

    buckets_by_source: Counter[str] = field(default_factory=Counter)
    bytes_by_source: Counter[str] = field(default_factory=Counter)
    checksum_failures: int = 0
    source_switches: int = 0
    source_failures: int = 0
    refusals: int = 0  # holders that answered with an error (busy, not held, ...)
    etcd_reads: int = 0  # range reads by pulls; a first look at a version seen by the watch is free
    pulls_completed: int = 0
    endpoints_opened: int = 0  # to holders, by pulls; a parked endpoint taken back is not new
    kept_endpoints_lost: int = 0  # kept endpoints the holder had hung up (KeptEndpointLost)
    buckets_served: int = 0
    bytes_served: int = 0
    requests_refused: int = 0
    records_written: int = 0  # holder records this process wrote to etcd
    versions_kept: int = 0  # held copies a same-contents re-publish did not make us drop
    manifests_parsed: int = 0  # each distinct manifest once while kept (UcxTransport._manifest)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["buckets_by_source"] = dict(self.buckets_by_source)
        out["bytes_by_source"] = dict(self.bytes_by_source)
        return out


@dataclass(frozen=True)
class HolderFaults:
    """Test-only failure injection on the serving side, deterministic (no randomness).

    corrupt_buckets: bucket indexes sent with one byte flipped (the held buffer stays intact).
    stall_after_buckets: after serving this many buckets in total, stop sending (hang), so a
    test can kill the process mid-pull.
    """

    corrupt_buckets: frozenset[int] = frozenset()
    stall_after_buckets: int | None = None


# --------------------------------------------------------------------------- ucxx set-up


def _ucx_env_defaults() -> None:
    """UCX settings that must be in the environment before ucxx is imported.

    ucxx endpoints from a listener always use peer error handling (we need it: a killed holder
    must fail the pull, not hang it). UCX then only picks transports that report peer failure,
    which excludes shared memory unless its error handling is switched on; without it
    intra-host pulls fall back to TCP loopback (measured here: ~1 GB/s against ~9 GB/s).
    ucxx also defaults rendezvous fragments to CUDA memory, which a CPU-only host lacks.
    Anything already set by the operator wins.
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
    # Measured here: pulls 10-60% faster, fan-out from one trainer 30-40% faster (the trainer
    # no longer copies for each puller).
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

    Progress defaults to 'blocking' (driven by the event loop on the worker's epoll fd): on
    small hosts the 'thread' mode measured 5-20x slower and 'polling' burns a core. ucxx's
    blocking mode spins once a message has come; `ucx_progress.install` mends it.
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
    """Whether pulls use a worker of their own, progressed by its own thread (ucx_progress.
    pull_context): on hosts without CUDA (the GPU path was measured on the process's worker),
    unless ROBUSTRL_UCX_PULL_THREAD=0.

    It was opt-in for a while, twice for a crash it did not cause. A trainer crash was a
    listener closed while UCX still took connections (ucx_listeners). Rollouts that died
    without a word when a hung holder resumed were ucxx's handshake letting UCX write into
    freed memory after a connect timed out (ucx_progress.exchange_peer_info), on either
    worker; faulthandler, on in every service since, showed it."""
    return os.environ.get("ROBUSTRL_UCX_PULL_THREAD", "1") != "0" and not torch.cuda.is_available()


def _ucx_errors(ucxx: ModuleType) -> tuple[type[BaseException], ...]:
    canceled: type[BaseException] = ucxx.exceptions.UCXCanceledError
    return (canceled.__mro__[1], ucxx.exceptions.UCXError)


def ucx_buffer(view: torch.Tensor) -> Any:
    """What ucxx sends from / receives into: numpy for host memory, the tensor itself on CUDA
    (ucxx reads __cuda_array_interface__)."""
    return view.numpy() if view.device.type == "cpu" else view


def bucket_ranges(indexes: Sequence[int]) -> list[list[int]]:
    """Ascending bucket indexes as [start, stop) ranges, as a request carries them: a whole
    version is one range however many buckets it has."""
    ranges: list[list[int]] = []
    for index in indexes:
        if ranges and ranges[-1][1] == index:
            ranges[-1][1] = index + 1
        else:
            ranges.append([index, index + 1])
    return ranges


def _data_tag(seq: int, index: int) -> int:
    return ((seq & 0x0FFFFFFF) << 32) | index


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"UCX address {address!r} is not host:port")
    return host, int(port)


# --------------------------------------------------------------------------- held versions


@dataclass
class _Held:
    manifest: BucketManifest
    buffer: torch.Tensor
    role: str
    manifest_revision: int  # mod revision of the manifest key this copy matches
    active_pullers: int = 0
    recorded_pullers: int = 0  # the count our etcd record has

    def bucket(self, index: int) -> torch.Tensor:
        return _bucket_view(self.manifest, self.buffer, index)


def changes_held_manifest(held_revision: int, event: Put | Delete) -> bool:
    """Whether a watched event on the manifest of a version we hold (written or read at
    `held_revision`) means what is published is no longer what we hold: a write or a delete
    after it. An earlier event is history that the held revision already replaced. It does
    come: a manifest write that timed out (etcd stalled) can still land, and the publish
    retried writes it again; the first write's event then arrives after the second was held.
    Treated as a change, it once made the trainer drop the version it had just published
    after an etcd outage, leaving no holder of it and every rollout waiting for it."""
    revision = event.revision if isinstance(event, Delete) else event.entry.mod_revision
    return revision > held_revision


def _bucket_view(manifest: BucketManifest, buffer: torch.Tensor, index: int) -> torch.Tensor:
    bucket = manifest.buckets[index]
    return buffer[bucket.offset : bucket.offset + bucket.nbytes]


# --------------------------------------------------------------------------- client side


class _Departures:
    """Holder records deleted while pulls receive from them, as the transport's watch of the
    job's versions sees them: each pull waits on the event of the holder it receives from."""

    def __init__(self) -> None:
        # (version, holder) -> (revision the holder was listed at, event)
        self._events: dict[tuple[int, str], tuple[int, asyncio.Event]] = {}

    def watch(self, version: int, instance_id: str, listed_at: int) -> asyncio.Event:
        event = asyncio.Event()
        self._events[(version, instance_id)] = (listed_at, event)
        return event

    def unwatch(self, version: int, instance_id: str) -> None:
        self._events.pop((version, instance_id), None)

    def watched(self) -> list[tuple[int, str]]:
        return list(self._events)

    def left(self, version: int, instance_id: str, revision: int) -> None:
        """The record was deleted at `revision`. A deletion from before the listing the pull
        chose the holder from does not count: the holder had registered again since."""
        watched = self._events.get((version, instance_id))
        if watched is not None and revision > watched[0]:
            watched[1].set()


class VersionsView:
    """The job's weight records (every version's manifest and holder records) as the
    transport's own watch last delivered them, and the etcd revision they stand at.

    A pull takes its first look at a version from here instead of reading etcd: the watch
    runs anyway (it drops superseded versions and tells pulls of departed holders). The read
    it spares took 1-12 ms (median 1.6) of a 64 MiB pull of 12-20 ms on two cores, and with
    N rollouts it is N range reads per version, each listing N holders. The view can lag etcd
    by the watch's delivery, the same staleness any listing has by the time it is used: a
    version it does not hold yet is read from etcd, and a pull re-lists from etcd once a
    holder fails it.
    """

    def __init__(self, wkeys: WeightKeys, job_id: str) -> None:
        self._wkeys = wkeys
        self._job_id = job_id
        self._entries: dict[bytes, Entry] = {}
        self.revision = 0  # 0 until the first listing arrives: nothing can be answered

    def reset(self, entries: Sequence[Entry], revision: int) -> None:
        self._entries = {e.key: e for e in entries}
        self.revision = revision

    def apply(self, event: Put | Delete | Resync) -> None:
        if isinstance(event, Resync):
            self.reset(event.entries, event.revision)
        elif isinstance(event, Put):
            self._entries[event.entry.key] = event.entry
            self.revision = max(self.revision, event.entry.mod_revision)
        else:
            self._entries.pop(event.key, None)
            self.revision = max(self.revision, event.revision)

    def version(self, version: int) -> tuple[list[Entry], int] | None:
        """The records of `version` and the revision they stand at, or None if the view has
        not seen its manifest (not listed yet, or not yet delivered by the watch)."""
        if self.revision == 0 or self._wkeys.manifest(self._job_id, version) not in self._entries:
            return None
        prefix = self._wkeys.version(self._job_id, version)
        return [e for k, e in self._entries.items() if k.startswith(prefix)], self.revision

    def versions(self) -> dict[int, list[str]]:
        """Each version whose manifest the view holds, with the holders it lists for it."""
        parsed = [p for key in self._entries if (p := self._wkeys.parse(self._job_id, key))]
        listed: dict[int, list[str]] = {v: [] for v, rest in parsed if rest == "manifest"}
        for version, rest in parsed:
            holder = rest.removeprefix("holders/")
            if version in listed and holder != rest:
                listed[version].append(holder)
        return {v: sorted(listed[v]) for v in sorted(listed)}


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
        context (ucx_progress.pull_context)."""
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

        No timeout here or in receive: a _SourceGuard bounds both by aborting the endpoint.

        The round trip cost a 64 MiB pull on 2 cores 0.6-0.9 ms, and a 1 GiB GPU pull on an
        H200 0.4-0.5. Tried and dropped, each timed side by side with this: posting the reply's
        receive before the request's send completed, and the holder posting its reply without
        waiting for it (no change in 3-4 runs each on 2 cores); posting the first receives of
        buckets before the reply came (on 2 cores no change; on the H200 the reply then came
        later, 0.73 ms against 0.46, and the pull was slower)."""
        self._seq += 1
        body = {
            "op": "pull",
            "protocol": PROTOCOL_VERSION,
            "seq": self._seq,
            "job_id": job_id,
            "version": version,
            "digest": digest,
            "buckets": bucket_ranges(buckets),
        }
        with self._aborted_is_reset():
            await ucx_progress.send_message(self._ep, json.dumps(body).encode())
            try:
                raw = await ucx_progress.receive_message(self._ep, MAX_CONTROL_BYTES)
            except ucx_progress.FrameError as exc:  # a holder of another protocol: pull elsewhere
                raise HolderRefused(
                    "bad_reply", f"protocol mismatch with {self.address}: {exc}"
                ) from exc
        try:
            reply = json.loads(raw)
            if reply.get("status") != "ok":
                raise HolderRefused(
                    str(reply.get("code", "unknown")),
                    str(reply.get("message", "")),
                    reply.get("held", []),
                )
            if int(reply["seq"]) != self._seq or int(reply["buckets"]) != len(buckets):
                raise ValueError(f"answers request {reply['seq']} with {reply['buckets']} buckets")
            size, total = int(reply["bucket_bytes"]), int(reply["total_bytes"])
            return self._seq, [(i, bucket_nbytes(i, size, total)) for i in buckets]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            detail = f"unreadable reply from {self.address}: {exc!r}"
            raise HolderRefused("bad_reply", detail) from exc

    async def receive(self, into: torch.Tensor, seq: int, index: int) -> None:
        with self._aborted_is_reset():
            await self._ep.recv(ucx_buffer(into), tag=_data_tag(seq, index))

    @contextlib.contextmanager
    def _aborted_is_reset(self) -> Iterator[None]:
        """An endpoint aborted under a call (by a _SourceGuard, between a request and its
        reply, say) fails it as a reset connection. ucxx raises AttributeError
        there: its endpoint's handle is gone. Seen in the demo as a rollout's first pull met
        its holder's record being deleted; it crashed the rollout."""
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


class _SourceGuard:
    """Ends an exchange with one holder by aborting its endpoint: once the holder's record is
    gone (`gone` is set), or once nothing has come from it for `stall` seconds.

    Aborting lets UCX fail the pending operations itself. Cancelling them from Python instead
    (a timeout around a receive) would release buffers UCX may still write into: a rollout
    died of a fault in libpython 1 s after such a cancel. A stopped holder keeps its endpoint
    open, so without this guard a receive from it would never end.

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

    async def __aenter__(self) -> _SourceGuard:
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


async def ask_holder(
    address: str,
    job_id: str,
    version: int,
    *,
    digest: str = "",
    buckets: Sequence[int] = (0,),
    timeout: float = 10.0,
) -> list[tuple[int, int]]:
    """Ask one holder whether it can serve these buckets (diagnostics and tests).

    Returns [(index, nbytes)] and receives the data into a scratch buffer, or raises
    HolderRefused carrying the holder's error code and message.
    """
    ucxx = load_ucxx()
    conn = await HolderConnection.open(ucxx, address, timeout)
    try:
        async with _SourceGuard(conn, address, asyncio.Event(), timeout) as guard:
            seq, sizes = await conn.request(job_id, version, digest, buckets)
            for index, nbytes in sizes:
                guard.progressed()
                await conn.receive(torch.zeros(nbytes, dtype=torch.uint8), seq, index)
            return sizes
    finally:
        await conn.close()


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
        faults: HolderFaults | None = None,
        seed: int | None = None,
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be at least 1")
        self.client = client
        self.keys = keys
        self.wkeys = WeightKeys(keys)
        self.job_id = job_id
        self.instance_id = instance_id
        self.epoch = epoch
        self.host = host
        self.port = port
        self.bucket_bytes = bucket_bytes
        self.keep_versions = keep_versions
        self.relay = relay
        self.max_pullers = max_pullers
        self.session_ttl = session_ttl
        self.pull_timeout = pull_timeout
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self.progress_mode = progress_mode
        self.pull_thread = _pull_thread_default() if pull_thread is None else pull_thread
        self.record_delay = record_delay
        self.park_seconds = park_seconds
        self.progress_every_s = progress_every_s
        if checksum_algorithm not in (None, *CHECKSUM_ALGORITHMS):
            raise ValueError(f"checksum_algorithm must be one of {CHECKSUM_ALGORITHMS}")
        # None: by where the published buffer lives (checksums.algorithm_for).
        self.checksum_algorithm = checksum_algorithm
        self.faults = faults or HolderFaults()
        self.counters = TransferCounters()
        self.last_pull: PullTimings | None = None  # where the last completed pull's time went
        self._rng = random.Random(instance_id if seed is None else seed)
        self._pool = ThreadPoolExecutor(
            max_workers=hash_threads or DEFAULT_HASH_THREADS,
            thread_name_prefix="ucx-weights-hash",
        )
        self._ucxx: ModuleType | None = None
        # What a failing source raises: timeouts, socket errors, leaving the holders, ucxx
        # errors (set by start).
        self._transfer_errors: tuple[type[BaseException], ...] = (TimeoutError, OSError, SourceLeft)
        self._listening: ucx_listeners.ListeningPort | None = None
        self._session: Session | None = None
        self._held: dict[int, _Held] = {}
        self._highest_epoch = 0  # of trainer epochs seen in manifests and announcements
        self._endpoints: set[Any] = set()
        self._serving: set[asyncio.Task[Any]] = set()  # connection handlers, cancelled on close
        self._record_lock = asyncio.Lock()
        self._record_due: set[int] = set()  # versions with a pullers count write scheduled
        self._tasks: list[asyncio.Task[None]] = []
        self._grpc: GrpcStreamTransport | None = None
        # A relay holds at most keep_versions versions, the one it pulls included (it drops
        # the oldest before it pulls: see _make_room); a non-relay one buffer.
        self._buffers = HostBuffers(keep_versions if relay else 1)
        # What publish and hold pack into: the versions held, and the one being packed.
        self._packs = HostBuffers(keep_versions + 1)
        self._idle: dict[str, HolderConnection] = {}  # holder address -> endpoint, between pulls
        self._departures = _Departures()
        self._view = VersionsView(self.wkeys, job_id)
        self._parsed: dict[bytes, BucketManifest] = {}  # raw manifest -> parsed (_manifest)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """host:port of this process's UCX listener (valid after start)."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Start the UCX listener and the etcd session holders register under."""
        self._ucxx = load_ucxx(self.progress_mode)
        self._transfer_errors = (TimeoutError, OSError, SourceLeft, *_ucx_errors(self._ucxx))
        try:
            self._listening = ucx_listeners.borrow(self._ucxx, self._serve, self.port)
        except Exception as exc:
            raise UcxUnavailable(f"UCX listener failed: {exc!r}") from exc
        self.port = self._listening.port
        self._session = await Session.open(self.client, self.session_ttl)
        self._tasks = [
            asyncio.create_task(self._keep_session(), name=f"ucx-weights-session-{self.job_id}"),
            asyncio.create_task(self._watch_versions(), name=f"ucx-weights-gc-{self.job_id}"),
        ]
        log.info("weights.ucx_started", job=self.job_id, address=self.address)

    async def close(self) -> None:
        """Stop serving, drop held buffers, revoke the lease (holder keys go at once)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        for task in serving:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if serving:
            await asyncio.sleep(0)  # ucxx retires its handler records one loop turn later
        for endpoint in list(self._endpoints):
            with contextlib.suppress(Exception):
                endpoint.abort(period=ABORT_NS)
        self._endpoints.clear()
        for conn in self._idle.values():
            await conn.close()
        self._idle.clear()
        if self._listening is not None:
            ucx_listeners.give_back(self._listening)  # never closed: see ucx_listeners
            self._listening = None
        self._held.clear()
        self._buffers.clear()
        self._packs.clear()
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def held_versions(self) -> list[int]:
        return sorted(self._held)

    def listed_versions(self) -> dict[int, list[str]]:
        """Versions whose manifest this transport's watch has delivered, with their holders: a
        pull of one of them starts without reading etcd."""
        return self._view.versions()

    def gauges(self) -> dict[str, float]:
        c = self.counters
        return {
            **super().gauges(),
            "weights_pulls": float(c.pulls_completed),
            "weights_checksum_failures": float(c.checksum_failures),
            "weights_source_failures": float(c.source_failures),
            "weights_source_switches": float(c.source_switches),
            "weights_refusals": float(c.refusals),
            "weights_buckets_served": float(c.buckets_served),
            "weights_bytes_served": float(c.bytes_served),
            "weights_versions_held": float(len(self._held)),
        }

    # ------------------------------------------------------------------ publish / hold

    async def publish(self, version: int, tensors: NamedTensors) -> None:
        """Trainer: pack, hash, write the manifest (fenced by epoch), hold, announce, GC.

        Fenced if a newer trainer epoch already published this version or announced.
        """
        manifest, buffer = await self._pack(version, self.epoch, tensors)
        revision = await self._write_manifest(manifest)
        self._highest_epoch = max(self._highest_epoch, self.epoch)
        self._held[version] = _Held(manifest, buffer, ROLE_TRAINER, revision)
        await self._register(version)
        self._prune_local()
        await self._collect_garbage(version)
        log.info(
            "weights.published",
            job=self.job_id,
            version=version,
            bytes=manifest.total_bytes,
            buckets=len(manifest.buckets),
            epoch=self.epoch,
        )

    async def _write_manifest(self, manifest: BucketManifest, attempts: int = 3) -> int:
        """Write manifest and announcement in one transaction unless a newer trainer epoch
        owns them (Fenced); the manifest's revision. Aborted if they keep changing under us;
        ManifestTooLarge, before any write, if etcd could not take it."""
        raw = manifest_for_etcd(manifest)
        tx = self.client.transactions
        key = self.wkeys.manifest(self.job_id, manifest.version)
        ann_key = self.wkeys.announcement(self.job_id)
        announcement = Announcement(
            self.job_id, manifest.version, self.address, self.epoch, self.name
        )
        for _ in range(attempts):
            current = await self.client.get(key)
            announced = await self.client.get(ann_key)
            newer = [
                _epoch_of(current.value) if current else 0,
                Announcement.from_json(announced.value).trainer_epoch if announced else 0,
            ]
            if max(newer) > self.epoch:
                raise Fenced(
                    f"job {self.job_id}: trainer epoch {max(newer)} publishes weights; "
                    f"this trainer has epoch {self.epoch}"
                )
            ok, responses = await self.client.transaction(
                compare=[
                    tx.mod(key) == current.mod_revision if current else tx.create(key) == 0,
                    tx.mod(ann_key) == announced.mod_revision
                    if announced
                    else tx.create(ann_key) == 0,
                ],
                success=[
                    tx.put(key, raw),
                    tx.put(ann_key, announcement.to_json()),
                ],
                failure=[],
            )
            if ok:
                return int(responses[0].response_put.header.revision)
        raise Aborted(f"job {self.job_id}: the weight records kept changing while publishing")

    async def hold(self, version: int, tensors: NamedTensors) -> None:
        """Relay: serve `version` from these tensors (already verified) to other pullers.

        A version this transport pulled is held already (when relay=True) and costs nothing
        here. Otherwise the tensors are packed against the published manifest and must match
        it bucket for bucket (WeightIntegrityError if not).
        """
        if version in self._held:
            return
        manifest, revision, _ = await self._read_version(version)
        entries, total, _ = plan_layout(tensors, manifest.bucket_bytes)
        if entries != manifest.tensors or total != manifest.total_bytes:
            raise WeightIntegrityError(f"version {version}: tensors do not match the manifest")
        device = tensors[0][1].device if tensors else torch.device("cpu")
        buffer = self._packs.take(total, device)
        await asyncio.to_thread(pack_into, tensors, entries, buffer)
        hashes = await self._hash_buckets(manifest, buffer, range(len(manifest.buckets)))
        if any(h != b.checksum for h, b in zip(hashes, manifest.buckets, strict=True)):
            raise WeightIntegrityError(f"version {version}: tensors do not match the manifest")
        self._held[version] = _Held(manifest, buffer, ROLE_RELAY, revision)
        await self._register(version)
        self._prune_local()

    async def _pack(
        self, version: int, epoch: int, tensors: NamedTensors
    ) -> tuple[BucketManifest, torch.Tensor]:
        entries, total, spans = plan_layout(tensors, self.bucket_bytes)
        device = tensors[0][1].device if tensors else torch.device("cpu")
        buffer = self._packs.take(total, device)
        await asyncio.to_thread(pack_into, tensors, entries, buffer)
        algorithm = self.checksum_algorithm or algorithm_for(device)
        loop = asyncio.get_running_loop()
        hashes = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, bucket_checksum, buffer[o : o + n], algorithm)
                for o, n in spans
            )
        )
        buckets = tuple(
            BucketEntry(i, o, n, h) for i, ((o, n), h) in enumerate(zip(spans, hashes, strict=True))
        )
        manifest = BucketManifest(
            self.job_id,
            version,
            epoch,
            total,
            self.bucket_bytes,
            entries,
            buckets,
            time.time(),
            algorithm,
        )
        return manifest, buffer

    async def _hash_buckets(
        self, manifest: BucketManifest, buffer: torch.Tensor, indexes: Sequence[int] | range
    ) -> list[str]:
        loop = asyncio.get_running_loop()
        views = [_bucket_view(manifest, buffer, i) for i in indexes]
        algorithm = manifest.checksum_algorithm
        hashes = await asyncio.gather(
            *(loop.run_in_executor(self._pool, bucket_checksum, v, algorithm) for v in views)
        )
        return list(hashes)

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
        self._highest_epoch = max(self._highest_epoch, announcement.trainer_epoch)
        return await self.pull(announcement.job_id, announcement.version)

    async def latest_version(self) -> int | None:
        """The newest version whose manifest comes from the highest trainer epoch seen."""
        entries, _ = await list_prefix(self.client, self.wkeys.versions(self.job_id))
        manifests: list[BucketManifest] = []
        for entry in entries:
            parsed = self.wkeys.parse(self.job_id, entry.key)
            if parsed is not None and parsed[1] == "manifest":
                manifests.append(self._manifest(entry.value))
        if not manifests:
            return None
        self._highest_epoch = max(self._highest_epoch, *(m.trainer_epoch for m in manifests))
        current = [m.version for m in manifests if m.trainer_epoch >= self._highest_epoch]
        return max(current) if current else None

    async def pull(
        self, job_id: str, version: int, *, device: torch.device | str = "cpu"
    ) -> NamedTensors:
        """Pull `version` from its holders, verify every bucket, return the tensors.

        The tensors are views of one buffer this transport keeps while it relays the version
        (relay=True); treat them as read-only (copy them into the model). A later pull receives
        into that buffer again only once none of them is left. WeightUnavailable if no holder
        can complete the pull within pull_timeout, or at once when every holder is gone and a
        newer manifest has replaced this one (see _superseded).
        """
        if job_id != self.job_id:
            raise ValueError(f"this transport serves job {self.job_id}, not {job_id}")
        held = self._held.get(version)
        if held is not None and held.manifest.trainer_epoch < self._highest_epoch:
            held = await self._current(held)
        if held is not None:
            return unpack_views(held.manifest, held.buffer)
        started = time.perf_counter()
        # The manifest and the holders listed with it, from the watch's view or one read.
        manifest, revision, holders = await self._read_version(version)
        timings = PullTimings(manifest_s=time.perf_counter() - started)
        if self.relay:
            self._make_room()
        buffer = self._buffers.take(manifest.total_bytes, device)
        progress = self.pulling = PullProgress(version, manifest.total_bytes, self.progress_every_s)
        try:
            with ucx_progress.pulling():
                await self._pull_buckets(manifest, revision, buffer, timings, progress, holders)
        finally:
            if self.pulling is progress:
                self.pulling = None
        self.counters.pulls_completed += 1
        self.last_pull = timings
        if self.relay and not self._closed:
            self._held[version] = _Held(manifest, buffer, ROLE_RELAY, revision)
            # Registered in the background: the caller has its tensors without waiting for an
            # etcd write, and a failed write is retried when the session keeper re-registers.
            self._schedule_record(version)
            self._prune_local()
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

    async def _current(self, held: _Held) -> _Held | None:
        """Our copy of a version once checked against its manifest in etcd: the announcement
        of a newer trainer epoch can come before our watch's event of the manifest written
        with it, and the copy of the older epoch is returned only if it has the same contents
        (see _republished). Likewise when our holder record could not be written because the
        manifest changed after we read it."""
        version = held.manifest.version
        current = await self.client.get(self.wkeys.manifest(self.job_id, version))
        if self._held.get(version) is not held:
            return self._held.get(version)  # the watch acted meanwhile
        if current is None:
            self._drop(version, "superseded")
        elif current.mod_revision > held.manifest_revision:
            self._republished(version, current.value, current.mod_revision)
        return self._held.get(version)

    async def _read_version(
        self, version: int
    ) -> tuple[BucketManifest, int, tuple[list[HolderRecord], int]]:
        """The manifest of this job's version, its mod revision, and its holders with the etcd
        revision they were listed at: from the watch's view if it has the version, else one
        range read (the holders' keys sit under the version's). A view that lists no holder
        that is not full has its holders listed again from etcd.

        The view can hold a manifest a moment before its publisher's holder record: a pull
        that took that for the whole listing would wait for a holder, or give the version up
        as stranded if a newer one exists (a benchmark run in make test did). It can also hold
        a manifest a moment after a newer trainer epoch replaced it; etcd is read then too.
        """
        seen = self._view.version(version)
        if seen is not None:
            try:
                manifest, revision, (holders, listed_at) = self._parse_version(version, *seen)
            except WeightUnavailable:
                # From an older trainer epoch than announced: the view has not had the event
                # of a restored trainer's manifest yet, and etcd may have it already.
                seen = None
        if seen is None:
            entries, listed_at = await list_prefix(
                self.client, self.wkeys.version(self.job_id, version)
            )
            self.counters.etcd_reads += 1
            return self._parse_version(version, entries, listed_at)
        if not any(not h.full for h in holders):
            holders, listed_at = await self._list_holders(manifest)
        return manifest, revision, (holders, listed_at)

    def _manifest(self, raw: bytes) -> BucketManifest:
        """BucketManifest.from_json of `raw`, parsed once while it is among the last
        PARSED_MANIFESTS seen (the watch parses each new one as it arrives, off the path of
        the pull that follows: see _watch_versions)."""
        manifest = self._parsed.get(raw)
        if manifest is None:
            manifest = self._parsed[raw] = BucketManifest.from_json(raw)
            self.counters.manifests_parsed += 1
            while len(self._parsed) > PARSED_MANIFESTS:
                del self._parsed[next(iter(self._parsed))]
        return manifest

    def _parse_version(
        self, version: int, entries: list[Entry], listed_at: int
    ) -> tuple[BucketManifest, int, tuple[list[HolderRecord], int]]:
        """_read_version's answer from a listing of the version's keys."""
        job_id = self.job_id
        key = self.wkeys.manifest(job_id, version)
        found = next((e for e in entries if e.key == key), None)
        if found is None:
            raise WeightUnavailable(f"no manifest for version {version} of job {job_id}")
        manifest = self._manifest(found.value)
        if manifest.trainer_epoch < self._highest_epoch:
            raise WeightUnavailable(
                f"version {version} of job {job_id} comes from trainer epoch "
                f"{manifest.trainer_epoch}, older than epoch {self._highest_epoch}: ignored"
            )
        self._highest_epoch = manifest.trainer_epoch
        holders = self._holders_of(manifest, [e for e in entries if e.key != key])
        return manifest, found.mod_revision, (holders, listed_at)

    async def _list_holders(self, manifest: BucketManifest) -> tuple[list[HolderRecord], int]:
        """Holders of exactly this manifest's contents, and the etcd revision of the list."""
        entries, revision = await list_prefix(
            self.client, self.wkeys.holders(manifest.job_id, manifest.version)
        )
        self.counters.etcd_reads += 1
        return self._holders_of(manifest, entries), revision

    def _holders_of(self, manifest: BucketManifest, entries: list[Entry]) -> list[HolderRecord]:
        holders = []
        for entry in entries:
            record = HolderRecord.from_json(entry.value)
            if record.digest == manifest.digest and record.instance_id != self.instance_id:
                holders.append(record)
        return holders

    async def _superseded(self, manifest: BucketManifest, manifest_revision: int) -> str | None:
        """Why pulling `manifest` no longer makes sense, or None: its manifest was deleted or
        replaced (a restored trainer republished the version), or a newer version or trainer
        epoch was published. A pull that has lost every holder stops then instead of waiting
        out pull_timeout for holders that will never come back."""
        entries, _ = await list_prefix(self.client, self.wkeys.versions(manifest.job_id))
        self.counters.etcd_reads += 1
        found = False
        for entry in entries:
            parsed = self.wkeys.parse(manifest.job_id, entry.key)
            if parsed is None or parsed[1] != "manifest":
                continue
            if parsed[0] == manifest.version:
                found = True
                if entry.mod_revision != manifest_revision:
                    return "its manifest was replaced"
                continue
            other = self._manifest(entry.value)
            if (other.trainer_epoch, other.version) > (manifest.trainer_epoch, manifest.version):
                return f"version {other.version} of trainer epoch {other.trainer_epoch} is newer"
        return None if found else "its manifest was deleted"

    async def _wait_for_holders(
        self, manifest: BucketManifest, revision: int, timeout: float, *, any_version: bool = False
    ) -> None:
        """Until a holder record of this version changes after `revision` (a relay appears, a
        busy holder frees a slot) or timeout: react at once, without polling etcd. With
        `any_version`, any change under the job's versions (a new manifest) wakes it too."""
        if any_version:
            prefix = self.wkeys.versions(manifest.job_id)
        else:
            prefix = self.wkeys.holders(manifest.job_id, manifest.version)
        await next_change(self.client, prefix, revision + 1, max(timeout, 0.01))

    async def _pull_buckets(
        self,
        manifest: BucketManifest,
        manifest_revision: int,
        buffer: torch.Tensor,
        timings: PullTimings,
        progress: PullProgress,
        first_listing: tuple[list[HolderRecord], int] | None = None,
    ) -> None:
        pending = set(range(len(manifest.buckets)))
        bad_from: dict[int, set[str]] = {}  # bucket -> holders that sent it corrupt
        excluded: set[str] = set()  # dead, hung or refusing holders, for this pull
        deadline = time.monotonic() + self.pull_timeout
        source: str | None = None  # the last holder that delivered buckets
        while pending:
            if first_listing is not None:
                (listed, revision), first_listing = first_listing, None
            else:
                listed, revision = await self._list_holders(manifest)
            usable = [
                h
                for h in listed
                if h.instance_id not in excluded
                and any(h.instance_id not in bad_from.get(b, ()) for b in pending)
            ]
            choice = choose_holder(usable, self._rng)
            if choice is None:
                left_s = deadline - time.monotonic()
                stranded = not any(h.instance_id not in excluded for h in listed)
                why = await self._superseded(manifest, manifest_revision) if stranded else None
                if left_s <= 0 or why is not None:
                    raise WeightUnavailable(
                        f"version {manifest.version} of job {manifest.job_id}: "
                        f"{len(pending)} of {len(manifest.buckets)} buckets left and no holder "
                        f"can serve them (excluded: {sorted(excluded)})"
                        + (f"; given up because {why}" if why else "")
                    )
                # Holders are busy or not there yet (a relay still pulling, a trainer
                # restarting).
                await self._wait_for_holders(
                    manifest, revision, min(left_s, 1.0), any_version=stranded
                )
                continue
            if source is not None and choice.instance_id != source:
                self.counters.source_switches += 1
                log.info(
                    "weights.source_switched",
                    version=manifest.version,
                    old=source,
                    new=choice.instance_id,
                    left=len(pending),
                )
            wanted = sorted(b for b in pending if choice.instance_id not in bad_from.get(b, ()))
            left = len(pending)
            try:
                gone = self._departures.watch(manifest.version, choice.instance_id, revision)
                try:
                    await self._pull_from(
                        choice, manifest, buffer, wanted, pending, bad_from, timings, progress, gone
                    )
                finally:
                    self._departures.unwatch(manifest.version, choice.instance_id)
            except HolderRefused as exc:
                self.counters.refusals += 1
                if exc.code == "busy":
                    # Its record lags its count: wait for the record (or another) to change.
                    await self._wait_for_holders(manifest, revision, 1.0)
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
                self.counters.kept_endpoints_lost += 1
                log.info(
                    "weights.kept_endpoint_lost",
                    version=manifest.version,
                    holder=choice.instance_id,
                    error=str(exc)[:200],
                )
            except self._transfer_errors as exc:
                self.counters.source_failures += 1
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

        A _SourceGuard aborts the endpoint once `gone` is set (the holder's record was deleted)
        or after stall_timeout without a bucket; the pull then fails with SourceLeft or
        TimeoutError."""
        checks = LandedChecks(manifest.checksum_algorithm, self._pool)
        started = time.perf_counter()
        conn = await self._connect(holder.address)
        guard = _SourceGuard(
            conn, holder.instance_id, gone, self.stall_timeout, self._transfer_errors
        )
        completed = False
        try:
            async with guard:
                try:
                    seq, sizes = await conn.request(
                        manifest.job_id, manifest.version, manifest.digest, wanted
                    )
                except self._transfer_errors as exc:
                    if conn.parks and guard.why() is None:
                        raise KeptEndpointLost(repr(exc)) from exc
                    raise
                guard.progressed()
                timings.request_s += time.perf_counter() - started
                started = time.perf_counter()
                expected = [(i, manifest.buckets[i].nbytes) for i in wanted]
                if sizes != expected:
                    raise HolderRefused(
                        "bad_reply", f"offered {sizes[:4]}..., asked {wanted[:4]}..."
                    )
                await self._receive(
                    conn, guard, manifest, buffer, seq, sizes, checks, timings, progress
                )
                completed = True
        finally:
            timings.receive_s += time.perf_counter() - started
            started = time.perf_counter()
            if completed and guard.why() is None:
                await self._park(conn)
            else:
                await conn.close()
            # Buckets that fully arrived count even when the source failed after them.
            for index, digest in await checks.results():
                bucket = manifest.buckets[index]
                if digest == bucket.checksum:
                    pending.discard(index)
                    self.counters.buckets_by_source[holder.instance_id] += 1
                    self.counters.bytes_by_source[holder.instance_id] += bucket.nbytes
                else:
                    self.counters.checksum_failures += 1
                    bad_from.setdefault(index, set()).add(holder.instance_id)
                    log.warning(
                        "weights.bucket_corrupt",
                        version=manifest.version,
                        bucket=index,
                        holder=holder.instance_id,
                    )
            timings.verify_wait_s += time.perf_counter() - started

    async def _receive(
        self,
        conn: HolderConnection,
        guard: _SourceGuard,
        manifest: BucketManifest,
        buffer: torch.Tensor,
        seq: int,
        sizes: list[tuple[int, int]],
        checks: LandedChecks,
        timings: PullTimings,
        progress: PullProgress,
    ) -> None:
        """Receive the buckets of one request, IN_FLIGHT_BUCKETS posted ahead, handing each
        to `checks` as it lands and counting it in `progress`."""
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
                view = _bucket_view(manifest, buffer, index)
                receives.append(
                    (index, view, asyncio.ensure_future(conn.receive(view, seq, index)))
                )
                if len(receives) >= IN_FLIGHT_BUCKETS:
                    await verify_next()
            while receives:
                await verify_next()
        finally:
            if receives:
                # Receives still posted into our buffer end with the endpoint (UCX fails them),
                # so waiting for them cannot outlast a frozen or dead source.
                await conn.close()
                await asyncio.gather(*(r for _, _, r in receives), return_exceptions=True)

    async def _connect(self, address: str) -> HolderConnection:
        """The endpoint kept from an earlier pull from address, else a new one.

        Connecting costs 5-15 ms here, a sixth to a third of a 256 MiB pull. A kept endpoint
        whose holder died fails at once (the peer reset it), like a new one would: a source
        failure.
        """
        kept = self._idle.pop(address, None)
        if kept is not None:
            return kept
        assert self._ucxx is not None
        conn = await HolderConnection.open(
            self.endpoints_for_pulls(), address, self.connect_timeout
        )
        self.counters.endpoints_opened += 1
        return conn

    def endpoints_for_pulls(self) -> Any:
        """What makes a puller's endpoints: with pull_thread, the worker of ours that a thread
        progresses (ucx_progress.pull_context), so UCX copies beside our checksums; else the
        process's worker, which serves as holder too."""
        assert self._ucxx is not None
        if self.pull_thread and self._ucxx.core._get_ctx().progress_mode == "blocking":
            return ucx_progress.pull_context(self._ucxx)
        return self._ucxx

    async def _park(self, conn: HolderConnection) -> None:
        """Keep an endpoint for the next pull; only one whose exchanges all completed, so no
        receive of ours is still posted on it."""
        if self._closed or conn.address in self._idle:
            await conn.close()
            return
        self._idle[conn.address] = conn
        while len(self._idle) > MAX_IDLE_CONNECTIONS:
            await self._idle.pop(next(iter(self._idle))).close()
        conn.parks += 1
        self._background(self._unpark_later(conn, conn.parks))

    async def _unpark_later(self, conn: HolderConnection, park: int) -> None:
        """Close a parked endpoint that no pull has taken since this park, park_seconds on."""
        await asyncio.sleep(self.park_seconds)
        if self._idle.get(conn.address) is conn and conn.parks == park:
            del self._idle[conn.address]
            await conn.close()

    # ------------------------------------------------------------------ serve

    async def _serve(self, endpoint: Any) -> None:
        """One puller's connection: answer requests until it hangs up."""
        self._endpoints.add(endpoint)
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        try:
            while not self._closed:
                try:
                    raw = await ucx_progress.receive_message(endpoint, MAX_CONTROL_BYTES)
                except ucx_progress.FrameError as exc:
                    # Not a request of ours: the endpoint is out of step, so close it.
                    self.counters.requests_refused += 1
                    log.warning("weights.bad_request", error=str(exc)[:200])
                    return
                except Exception:
                    return  # the puller closed or died: nothing to answer
                try:
                    await self._answer(endpoint, raw)
                except self._transfer_errors as exc:
                    log.info("weights.serve_aborted", error=repr(exc)[:200])
                    return
        finally:
            self._endpoints.discard(endpoint)
            if task is not None:
                self._serving.discard(task)
            with contextlib.suppress(Exception):
                endpoint.abort(period=ABORT_NS)

    def _check_request(self, request: dict[str, Any]) -> tuple[_Held, list[int]]:
        """The held version and bucket list a request asks for, or HolderRefused saying why."""
        if request.get("op") != "pull" or request.get("protocol") != PROTOCOL_VERSION:
            raise HolderRefused("bad_request", f"unsupported request {request.get('op')!r}")
        job_id, version = request.get("job_id"), request.get("version")
        if not isinstance(version, int):
            raise HolderRefused("bad_request", f"version must be an integer, got {version!r}")
        held = self._held.get(version) if job_id == self.job_id else None
        if held is None:
            raise HolderRefused(
                "not_held",
                f"holder {self.instance_id} holds versions {self.held_versions()} of job "
                f"{self.job_id}, not version {version} of job {job_id}",
                self.held_versions(),
            )
        digest = request.get("digest", "")
        if digest and digest != held.manifest.digest:
            raise HolderRefused(
                "digest_mismatch",
                f"holder {self.instance_id} holds a different version {version} "
                f"(trainer epoch {held.manifest.trainer_epoch})",
                self.held_versions(),
            )
        ranges = request.get("buckets", [])
        count = len(held.manifest.buckets)
        if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(i) is int for i in r) and r[0] < r[1]
            for r in ranges
        ):
            raise HolderRefused("bad_request", "buckets must be a list of [start, stop) ranges")
        missing = [r for r in ranges if not 0 <= r[0] < r[1] <= count]
        if missing:
            raise HolderRefused(
                "no_such_bucket",
                f"version {version} has buckets 0..{count - 1}; asked for {missing[:8]}",
                self.held_versions(),
            )
        buckets = [i for start, stop in ranges for i in range(start, stop)]
        if self.max_pullers and held.active_pullers >= self.max_pullers:
            raise HolderRefused("busy", f"holder {self.instance_id} serves {held.active_pullers}")
        return held, buckets

    async def _answer(self, endpoint: Any, raw: bytes) -> None:
        seq = 0
        try:
            request = json.loads(raw)
            seq = int(request.get("seq", 0))
            held, buckets = self._check_request(request)
        except (ValueError, AttributeError, HolderRefused) as exc:
            refusal = (
                exc if isinstance(exc, HolderRefused) else HolderRefused("bad_request", str(exc))
            )
            self.counters.requests_refused += 1
            reply = {
                "status": "error",
                "seq": seq,
                "code": refusal.code,
                "message": refusal.message,
                "held": refusal.held,
            }
            await ucx_progress.send_message(endpoint, json.dumps(reply).encode())
            return
        # Take the slot before the first await, so two requests cannot both pass the cap.
        held.active_pullers += 1
        self._pullers_changed(held)
        try:
            manifest = held.manifest
            reply_ok = {
                "status": "ok",
                "seq": seq,
                "buckets": len(buckets),
                "bucket_bytes": manifest.bucket_bytes,
                "total_bytes": manifest.total_bytes,
            }
            await ucx_progress.send_message(endpoint, json.dumps(reply_ok).encode())
            sends: collections.deque[asyncio.Future[Any]] = collections.deque()
            try:
                for index in buckets:
                    await self._maybe_stall(sum(not send.done() for send in sends))
                    view = held.bucket(index)
                    if index in self.faults.corrupt_buckets:
                        view = view.clone()
                        view[0] ^= 0xFF
                    send = asyncio.ensure_future(
                        ucx_progress.send(endpoint, ucx_buffer(view), _data_tag(seq, index))
                    )
                    send.add_done_callback(functools.partial(self._count_sent, int(view.numel())))
                    sends.append(send)
                    if len(sends) >= IN_FLIGHT_BUCKETS:
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
            self.counters.buckets_served += 1
            self.counters.bytes_served += nbytes

    async def _maybe_stall(self, in_flight: int) -> None:
        limit = self.faults.stall_after_buckets
        if limit is not None and self.counters.buckets_served + in_flight >= limit:
            log.warning("weights.fault_stall", served=self.counters.buckets_served)
            await asyncio.Event().wait()  # hang like a wedged process; the test kills us

    # ------------------------------------------------------------------ etcd records

    def _record(self, held: _Held) -> HolderRecord:
        return HolderRecord(
            instance_id=self.instance_id,
            address=self.address,
            role=held.role,
            trainer_epoch=held.manifest.trainer_epoch,
            digest=held.manifest.digest,
            active_pullers=held.active_pullers,
            max_pullers=self.max_pullers,
        )

    async def _register(self, version: int) -> None:
        """Write our holder record for version, only while its manifest is the one we hold."""
        async with self._record_lock:
            held = self._held.get(version)
            if held is None or self._session is None or self._closed:
                return
            tx = self.client.transactions
            manifest_key = self.wkeys.manifest(self.job_id, version)
            record = self._record(held)
            try:
                ok, _ = await self.client.transaction(
                    compare=[tx.mod(manifest_key) == held.manifest_revision],
                    success=[
                        tx.put(
                            self.wkeys.holder(self.job_id, version, self.instance_id),
                            record.to_json(),
                            lease=self._session.lease_id,
                        )
                    ],
                    failure=[],
                )
            except aetcd.exceptions.ClientError as exc:
                if not lease_gone(exc):
                    raise
                # The session lapsed (etcd was unreachable past its TTL) and its keepalive has
                # not noticed yet: `_keep_session` opens the next one and registers every held
                # version under it, this one included.
                log.info("weights.record_deferred", version=version, reason="lease gone")
                return
            if ok:
                held.recorded_pullers = record.active_pullers
                self.counters.records_written += 1
                if self._record_lags_cap(held):
                    # The holder filled up or freed its slot while this write was under way (a
                    # pull shorter than an etcd write): say so at once, not record_delay later.
                    self._schedule_record(version)
        if not ok and held is self._held.get(version):
            # Deleted (GC), or written again after we read it: by a restored trainer, maybe
            # with the bytes we hold (a pull that finished from its standby does) and kept.
            await self._current(held)

    def _schedule_record(self, version: int) -> None:
        self._background(self._register_quietly(version))

    def _pullers_changed(self, held: _Held) -> None:
        """Bring our record's pullers count up to date: at once if the holder just filled up
        or freed its last slot (pullers skip a full holder and wait for a busy one's record to
        change), else record_delay later (see PULLERS_RECORD_DELAY_S)."""
        version = held.manifest.version
        if self._record_lags_cap(held):
            self._schedule_record(version)
        elif version not in self._record_due:
            self._record_due.add(version)
            self._background(self._record_pullers_later(version))

    def _record_lags_cap(self, held: _Held) -> bool:
        """Whether our record says full where we are not, or the other way round."""
        cap = self.max_pullers
        return bool(cap) and (held.active_pullers >= cap) != (held.recorded_pullers >= cap)

    async def _record_pullers_later(self, version: int) -> None:
        try:
            await asyncio.sleep(self.record_delay)
        finally:
            self._record_due.discard(version)
        held = self._held.get(version)
        if held is not None and held.active_pullers != held.recorded_pullers:
            await self._register_quietly(version)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run work as a task of this transport's, cancelled by close."""
        task = asyncio.create_task(work)
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def _register_quietly(self, version: int) -> None:
        # The pullers count is a hint for load spreading; a failed update must not fail serving.
        try:
            await self._register(version)
        except aetcd.exceptions.ClientError as exc:
            log.info("weights.record_update_failed", version=version, error=repr(exc)[:200])

    def _drop(self, version: int, reason: str) -> None:
        if self._held.pop(version, None) is not None:
            log.info("weights.dropped", job=self.job_id, version=version, reason=reason)
            if not self._closed:
                self._background(self._unregister(version))

    async def _unregister(self, version: int) -> None:
        """Delete our holder record of a dropped version (GC may have deleted it already)."""
        async with self._record_lock:
            if version in self._held:
                return  # held again meanwhile: the record is current
            try:
                await self.client.delete(self.wkeys.holder(self.job_id, version, self.instance_id))
            except aetcd.exceptions.ClientError as exc:
                # It still goes with our lease; pullers skip records they cannot use.
                log.info("weights.unregister_failed", version=version, error=repr(exc)[:200])

    def _oldest_first(self) -> list[int]:
        """Held versions, the first to drop first: an older trainer epoch's before the newest
        (a restored trainer went back to its checkpoint's version), then by version."""
        return sorted(self._held, key=lambda v: (self._held[v].manifest.trainer_epoch, v))

    def _prune_local(self) -> None:
        for version in self._oldest_first()[: -self.keep_versions]:
            self._drop(version, "superseded")

    def _make_room(self) -> None:
        """Before a relay pulls: drop what it holds beyond keep_versions - 1, so the pull can
        receive into the buffer of the version dropped (once no transfer and no caller uses
        it). A rollout (keep_versions=1) stages one model copy, not the one it relays plus the
        one it pulls. What it dropped is superseded: its peers pull the new version too, and
        the trainer keeps two."""
        excess = len(self._held) - (self.keep_versions - 1)
        for version in self._oldest_first()[: max(excess, 0)]:
            self._drop(version, "superseded")

    async def _collect_garbage(self, newest: int) -> None:
        """Delete the etcd keys of versions older than the newest keep_versions."""
        entries, _ = await list_prefix(self.client, self.wkeys.versions(self.job_id))
        versions = sorted(
            {
                parsed[0]
                for e in entries
                if (parsed := self.wkeys.parse(self.job_id, e.key)) and parsed[1] == "manifest"
            }
        )
        for version in versions[: -self.keep_versions]:
            if version < newest:
                await self.client.delete_prefix(self.wkeys.version(self.job_id, version))
                log.info("weights.gc", job=self.job_id, version=version)

    async def _watch_versions(self) -> None:
        """Keep the view of the job's weight records; drop held versions whose manifest was
        deleted (GC) or replaced (newer epoch); tell pulls of holder records that go."""
        prefix = self.wkeys.versions(self.job_id)
        entries, revision = await list_prefix(self.client, prefix)
        self._view.reset(entries, revision)
        async for event in watch_prefix(self.client, prefix, revision + 1):
            self._view.apply(event)
            if isinstance(event, Resync):
                present = {self.wkeys.parse(self.job_id, e.key) for e in event.entries}
                for version, instance_id in self._departures.watched():
                    if (version, f"holders/{instance_id}") not in present:
                        self._departures.left(version, instance_id, event.revision)
                manifests = {
                    parsed[0]: e
                    for e in event.entries
                    if (parsed := self.wkeys.parse(self.job_id, e.key)) and parsed[1] == "manifest"
                }
                for version, held in list(self._held.items()):
                    if held.manifest_revision > event.revision:
                        continue  # written after this listing: the events after it tell
                    now = manifests.get(version)
                    if now is None:
                        self._drop(version, "superseded")
                    elif now.mod_revision != held.manifest_revision:
                        self._republished(version, now.value, now.mod_revision)
                continue
            key = event.entry.key if isinstance(event, Put) else event.key
            parsed = self.wkeys.parse(self.job_id, key)
            if parsed is not None and isinstance(event, Delete):
                holder = parsed[1].removeprefix("holders/")
                if holder != parsed[1]:
                    self._departures.left(parsed[0], holder, event.revision)
                    continue
            if parsed is None or parsed[1] != "manifest":
                continue
            if parsed[0] not in self._held:
                if isinstance(event, Put):
                    # Parsed now, before a pull of it asks (a bad one is reported by that pull).
                    with contextlib.suppress(WeightIntegrityError):
                        self._manifest(event.entry.value)
                continue
            version = parsed[0]
            if not changes_held_manifest(self._held[version].manifest_revision, event):
                continue
            if isinstance(event, Delete):
                self._drop(version, "superseded")
            else:
                self._republished(version, event.entry.value, event.entry.mod_revision)

    def _republished(self, version: int, raw: bytes, revision: int) -> None:
        """The manifest of a version we hold was written again: a relay whose copy has the new
        manifest's contents (a restored trainer published its checkpoint's version again, bit
        for bit) serves it under the new manifest; anything else is dropped, as is a manifest
        from an epoch older than the newest seen. The trainer that published the old one is
        fenced by the new epoch and never keeps it."""
        held = self._held[version]
        try:
            manifest = self._manifest(raw)
        except WeightIntegrityError as exc:
            log.warning("weights.bad_manifest", version=version, error=str(exc)[:200])
            manifest = None
        same = (
            manifest is not None
            and held.role == ROLE_RELAY
            and manifest.digest == held.manifest.digest
            and manifest.trainer_epoch >= max(held.manifest.trainer_epoch, self._highest_epoch)
        )
        if manifest is None or not same:
            self._drop(version, "manifest_changed")
            return
        held.manifest = manifest
        held.manifest_revision = revision
        self._highest_epoch = manifest.trainer_epoch
        self.counters.versions_kept += 1
        log.info(
            "weights.kept",
            job=self.job_id,
            version=version,
            epoch=manifest.trainer_epoch,
            reason="republished with the same contents",
        )
        # Our record says the old epoch, and its write is fenced by the old revision: the new
        # one is written under the new revision.
        self._schedule_record(version)

    async def _keep_session(self) -> None:
        """If the lease is lost (etcd away longer than its TTL), open a new one and register
        the held versions again, so this holder comes back once etcd does."""
        while not self._closed:
            assert self._session is not None
            await self._session.done.wait()
            if self._closed:
                return
            log.warning("weights.session_lost", job=self.job_id)
            delay = 0.2
            while not self._closed:
                try:
                    self._session = await Session.open(self.client, self.session_ttl)
                    for version in list(self._held):
                        await self._register(version)
                    break
                except aetcd.exceptions.ClientError as exc:
                    log.info("weights.session_retry", error=repr(exc)[:200])
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)


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
