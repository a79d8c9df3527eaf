"""The weight plane's protocol: what a version is, how it is cut into buckets and checksummed,
what etcd records about it, and the messages a puller and a holder exchange over UCX.

Pure data and pure functions; the UCX transport (ucx/) moves and verifies what this module
describes. (The gRPC stream, grpc_stream.py, sends trainer.proto's WeightManifest instead: one
sha256 over the whole buffer.)

Records in etcd, under the job's key prefix:

    <prefix>/weights/<job_id>                                Announcement (transport.py)
    <prefix>/weights/<job_id>/v/<V:012d>/manifest            BucketManifest, no lease
    <prefix>/weights/<job_id>/v/<V:012d>/holders/<instance>  HolderRecord, the holder's lease

The manifest (`BucketManifest.to_json`) is one JSON object; a trainer writes it with the
announcement in one transaction, so it must fit one etcd write (`manifest_for_etcd`):

    job_id, version, trainer_epoch   which version, published by which trainer epoch
    total_bytes                      size of the packed buffer: every tensor, in manifest order,
                                     each starting at a multiple of ALIGN_BYTES, gaps zeroed
    bucket_bytes                     bucket i is bytes [i * bucket_bytes, (i + 1) * bucket_bytes)
                                     of the buffer, the last one shorter (`bucket_nbytes`)
    tensors                          [[name, dtype, shape, offset, nbytes], ...]
    checksums                        one hex string per bucket, in bucket order
    published_at                     unix seconds
    checksum_algorithm               what made the checksums (checksums.CHECKSUM_ALGORITHMS):
                                     every puller verifies with the one its manifest names
    digest                           sha256 of the algorithm, tensor rows and bucket rows
                                     (`manifest_digest`): equal digests, bitwise-equal buffers

A holder record (`HolderRecord.to_json`): instance_id, address (host:port of its UCX listener),
role (trainer or relay), trainer_epoch and digest of the manifest it holds, active_pullers and
max_pullers (0: no limit), which pullers read to spread their load, and the buckets it holds:
[first_bucket, stop_bucket), stop_bucket null for through the last. A relay holds every bucket;
each rank of a sharded trainer group holds its own range (`bucket_share`), so a version is
served whole only by the ranks together.

UCX messages, on one endpoint from a puller to a holder, in this order:

    1. request  control message  {"op": "pull", "protocol": PROTOCOL_VERSION, "seq": n,
                                  "job_id", "version", "digest", "buckets": [[start, stop], ...]}
       seq counts the endpoint's requests from 1; digest is the manifest's ("" skips the
       check); buckets are ascending [start, stop) ranges (`bucket_ranges`).
    2. reply    control message  {"status": "ok", "seq": n, "buckets": count, "bucket_bytes",
                                  "total_bytes"}   (each bucket's size follows from these)
                             or  {"status": "error", "seq": n, "code", "message", "held"}
    3. on ok, one tagged message per bucket asked for, in ascending order: the bucket's bytes,
       tag `data_tag(seq, index)` (ucxx mixes it with the endpoint's own tag).
    Then the next request on the same endpoint, or the puller hangs up.

A control message is one UCX message of FRAME_BYTES: an 8-byte header (FRAME_MAGIC, the body's
length as a little-endian u32) and the body; a body longer than fits follows in a second
message. A receiver refuses (FrameError) a message without the magic or a body over its limit
(MAX_CONTROL_BYTES for requests and replies), and closes that endpoint: it is out of step.

Error codes of a reply: bad_request (not a request this holder reads), not_held (that job and
version are not held here), digest_mismatch (held, with other contents), no_such_bucket, busy
(at max_pullers: the puller waits for the record to change). A puller that cannot read a reply
counts it as bad_reply. A holder never sends bytes it was not asked for, and answers a version
or bucket it does not hold only with an error reply.

The checksums guard against corruption: flipped bits, torn or misplaced transfers, a holder
serving a broken copy. They are no defence against an adversary: no algorithm here is
collision resistant, and the manifest comes from etcd unsigned (whoever can write etcd or pose
as a holder is trusted already).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from robustrl.weights.checksums import CHECKSUM_ALGORITHMS, XXH3_128
from robustrl.weights.transport import WeightIntegrityError

DEFAULT_BUCKET_BYTES = 32 << 20
ALIGN_BYTES = 64  # every tensor starts aligned, so views of the buffer are valid for any dtype
MAX_MANIFEST_BYTES = 1 << 20
"""Bytes of a manifest a trainer writes: etcd takes requests of up to 1.5 MiB by default
(--max-request-bytes), and the manifest's transaction carries the announcement too: about
28,000 buckets (0.9 TB in 32 MiB buckets) beside 1,000 tensors."""

PROTOCOL_VERSION = 2
MAX_CONTROL_BYTES = 1 << 20  # requests and replies are small JSON; refuse anything bigger
IN_FLIGHT_BUCKETS = 4
"""Buckets posted ahead on one endpoint (sends on the holder, receives on the puller), so one
bucket's completion never waits for the event loop to post the next (docs/decisions/0112)."""

ROLE_TRAINER = "trainer"
ROLE_RELAY = "relay"

BAD_REQUEST = "bad_request"
NOT_HELD = "not_held"
DIGEST_MISMATCH = "digest_mismatch"
NO_SUCH_BUCKET = "no_such_bucket"
BUSY = "busy"
BAD_REPLY = "bad_reply"


class ManifestTooLarge(ValueError):
    """A version whose manifest etcd cannot take in one write: too many buckets."""


class HolderRefused(Exception):
    """A holder answered a request with an explicit error (protocol level, not transport)."""

    def __init__(self, code: str, message: str, held: Sequence[int] = ()) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.held = list(held)


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
        manifest: a pull compares it with every holder's record (docs/decisions/0111)."""
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


def bucket_share(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """The buckets [first, stop) rank `rank` of `world_size` holds of a version of `count`
    buckets: contiguous ranges, as even as they come (empty when there are fewer buckets than
    ranks)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return count * rank // world_size, count * (rank + 1) // world_size


def tensor_dtype(entry: TensorEntry) -> torch.dtype:
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightIntegrityError(f"{entry.name}: unknown dtype {entry.dtype!r}")
    return dtype


def _check_tensors(manifest: BucketManifest) -> None:
    """WeightIntegrityError unless every tensor is a known dtype whose bytes lie whole, and
    aligned to its element, within total_bytes (buffers.unpack_views relies on it)."""
    for entry in manifest.tensors:
        dtype = tensor_dtype(entry)
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


# --------------------------------------------------------------------------- holder records


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
    first_bucket: int = 0
    stop_bucket: int | None = None
    """The buckets it holds, [first_bucket, stop_bucket); None: through the last. A trainer
    rank of a sharded group holds its own range of every version it publishes."""

    def to_json(self) -> bytes:
        fields = asdict(self)
        if self.first_bucket == 0 and self.stop_bucket is None:
            # A whole copy's record reads as before ranges existed, to a puller of an older
            # release too.
            del fields["first_bucket"], fields["stop_bucket"]
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> HolderRecord:
        return cls(**json.loads(raw))

    @property
    def full(self) -> bool:
        return self.max_pullers > 0 and self.active_pullers >= self.max_pullers

    def holds(self, index: int) -> bool:
        return self.first_bucket <= index and (self.stop_bucket is None or index < self.stop_bucket)


# --------------------------------------------------------------------------- UCX messages


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


def data_tag(seq: int, index: int) -> int:
    """The tag of bucket `index` answering request `seq` on one endpoint."""
    return ((seq & 0x0FFFFFFF) << 32) | index


@dataclass(frozen=True)
class PullRequest:
    """A puller's request for buckets of one version. Decoded, its fields are as the puller
    sent them: the holder checks them (`check_form`, `bucket_indexes`) before it trusts them."""

    seq: int
    job_id: Any
    version: Any
    digest: Any = ""
    buckets: Any = ()  # [start, stop) ranges (bucket_ranges)
    op: Any = "pull"
    protocol: Any = PROTOCOL_VERSION

    def encode(self) -> bytes:
        fields = ("op", "protocol", "seq", "job_id", "version", "digest", "buckets")
        return json.dumps({name: getattr(self, name) for name in fields}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PullRequest:
        """The request in raw; ValueError or AttributeError if it is not a JSON object with an
        integer seq (a bad_request whose seq is unknown)."""
        body = json.loads(raw)
        return cls(
            seq=int(body.get("seq", 0)),
            job_id=body.get("job_id"),
            version=body.get("version"),
            digest=body.get("digest", ""),
            buckets=body.get("buckets", []),
            op=body.get("op"),
            protocol=body.get("protocol"),
        )

    def check_form(self) -> None:
        """HolderRefused (bad_request) unless this is a pull of this protocol naming an
        integer version."""
        if self.op != "pull" or self.protocol != PROTOCOL_VERSION:
            raise HolderRefused(BAD_REQUEST, f"unsupported request {self.op!r}")
        if not isinstance(self.version, int):
            raise HolderRefused(BAD_REQUEST, f"version must be an integer, got {self.version!r}")

    def bucket_indexes(self, count: int, held: Sequence[int]) -> list[int]:
        """The bucket indexes asked for, of a version of `count` buckets; HolderRefused
        (bad_request, or no_such_bucket carrying the `held` versions) otherwise."""
        ranges = self.buckets
        if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(i) is int for i in r) and r[0] < r[1]
            for r in ranges
        ):
            raise HolderRefused(BAD_REQUEST, "buckets must be a list of [start, stop) ranges")
        missing = [r for r in ranges if not 0 <= r[0] < r[1] <= count]
        if missing:
            raise HolderRefused(
                NO_SUCH_BUCKET,
                f"version {self.version} has buckets 0..{count - 1}; asked for {missing[:8]}",
                held,
            )
        return [i for start, stop in ranges for i in range(start, stop)]


@dataclass(frozen=True)
class PullReply:
    """A holder's yes to a request: the buckets follow, each of the size the layout gives."""

    seq: int
    buckets: int  # how many follow
    bucket_bytes: int
    total_bytes: int

    def encode(self) -> bytes:
        return json.dumps({"status": "ok", **asdict(self)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PullReply:
        """The reply in raw. HolderRefused for an error reply; ValueError, KeyError, TypeError
        or AttributeError for anything unreadable."""
        reply = json.loads(raw)
        if reply.get("status") != "ok":
            raise HolderRefused(
                str(reply.get("code", "unknown")),
                str(reply.get("message", "")),
                reply.get("held", []),
            )
        return cls(
            int(reply["seq"]),
            int(reply["buckets"]),
            int(reply["bucket_bytes"]),
            int(reply["total_bytes"]),
        )


def refusal_reply(seq: int, refusal: HolderRefused) -> bytes:
    """The error reply that tells a puller why its request `seq` was refused."""
    reply = {
        "status": "error",
        "seq": seq,
        "code": refusal.code,
        "message": refusal.message,
        "held": refusal.held,
    }
    return json.dumps(reply).encode()


FRAME_BYTES = 4096
"""Bytes of a control message's first UCX message: its header and as much of its body as
fits. A longer body follows in a second message."""
FRAME_HEADER = struct.Struct("<4sI")
FRAME_MAGIC = b"rrl\x02"


class FrameError(ValueError):
    """A control message that is not one of ours, or longer than its receiver takes."""


def frame_header(length: int) -> bytes:
    return FRAME_HEADER.pack(FRAME_MAGIC, length)


def read_frame_header(frame: bytes | bytearray, limit: int) -> int:
    """The body length a control message's first UCX message announces; FrameError if it is
    not one of ours or the body is over `limit` bytes."""
    magic, length = FRAME_HEADER.unpack_from(frame)
    if magic != FRAME_MAGIC:
        raise FrameError(f"not a control message of this protocol (starts {bytes(frame[:8])!r})")
    if length > limit:
        raise FrameError(f"control message of {length} bytes; at most {limit} are taken")
    return int(length)
