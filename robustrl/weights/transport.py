"""Weight versions: manifests, packing, and the transports that move them.

The trainer publishes version V: it packs the tensors into one buffer in manifest order
(name, dtype, shape, offset, size), records the sha256 of the buffer, and announces
`<prefix>/weights/<job_id>` = {version, address, trainer_epoch, transport} in etcd. A
rollout that sees a newer version pulls it, verifies size and checksum, and only then hands
the tensors to its engine, so a corrupt or partial transfer is never loaded.

`WeightTransport` is the seam: `GrpcStreamTransport` (here) streams chunks over gRPC and is
the fallback and the benchmark baseline; a UCX transport plugs in behind the same calls.
This module needs torch: the coordinator and monitor never import it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aetcd
import grpc
import numpy as np
import torch

from robustrl.contracts.errors import FailedPrecondition
from robustrl.contracts.keys import KeySpace
from robustrl.core.channels import open_channel
from robustrl.core.logs import get_logger
from robustrl.v1 import trainer_pb2, trainer_pb2_grpc

log = get_logger(__name__)

CHUNK_BYTES = 1 << 20
PULL_DEADLINE = 120.0
PULL_PROGRESS_EVERY_S = 5.0
"""How often a pull still under way logs how far it has come (`weights.pull_progress`)."""

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightIntegrityError(ValueError):
    """What arrived does not match the manifest (size or checksum): never load it."""


@dataclass(frozen=True)
class Announcement:
    """The latest version of a job's weights and where to get it (the etcd record)."""

    job_id: str
    version: int
    address: str
    trainer_epoch: int
    transport: str

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Announcement:
        return cls(**json.loads(raw))


def pack(
    job_id: str, version: int, trainer_epoch: int, tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[trainer_pb2.WeightManifest, bytes]:
    manifest = trainer_pb2.WeightManifest(
        job_id=job_id, version=version, trainer_epoch=trainer_epoch
    )
    parts: list[bytes] = []
    offset = 0
    for name, tensor in tensors:
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        manifest.tensors.add(
            name=name,
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape),
            offset=offset,
            nbytes=len(data),
        )
        parts.append(data)
        offset += len(data)
    blob = b"".join(parts)
    manifest.total_bytes = len(blob)
    manifest.sha256 = hashlib.sha256(blob).hexdigest()
    return manifest, blob


def unpack(manifest: trainer_pb2.WeightManifest, blob: bytes) -> NamedTensors:
    """The tensors in blob, after checking its size and checksum against the manifest."""
    _check_arrived(manifest, len(blob), hashlib.sha256(blob).hexdigest())
    return _tensors_in(manifest, torch.frombuffer(bytearray(blob), dtype=torch.uint8))


def _check_arrived(manifest: trainer_pb2.WeightManifest, nbytes: int, sha256: str) -> None:
    """WeightIntegrityError unless what arrived has the manifest's size and checksum."""
    if nbytes != manifest.total_bytes:
        raise WeightIntegrityError(
            f"version {manifest.version}: got {nbytes} bytes, "
            f"the manifest says {manifest.total_bytes}"
        )
    if sha256 != manifest.sha256:
        raise WeightIntegrityError(f"version {manifest.version}: checksum mismatch")


def _tensors_in(manifest: trainer_pb2.WeightManifest, buffer: torch.Tensor) -> NamedTensors:
    """The manifest's tensors in a verified buffer: views where a tensor's offset suits its
    dtype, copies where it does not (the gRPC layout packs tensors back to back, unaligned)."""
    out: NamedTensors = []
    for info in manifest.tensors:
        dtype = getattr(torch, info.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightIntegrityError(f"{info.name}: unknown dtype {info.dtype!r}")
        end = info.offset + info.nbytes
        if info.nbytes != math.prod(info.shape) * dtype.itemsize or end > buffer.numel():
            raise WeightIntegrityError(
                f"{info.name}: {info.nbytes} bytes at offset {info.offset} do not hold a "
                f"{info.dtype} tensor of shape {list(info.shape)} inside "
                f"{buffer.numel()} bytes"
            )
        raw = buffer[info.offset : end]
        if info.offset % dtype.itemsize:
            raw = raw.clone()
        out.append((info.name, raw.view(dtype).reshape(tuple(info.shape))))
    return out


_hash_thread: ThreadPoolExecutor | None = None


def _hashing() -> ThreadPoolExecutor:
    """One thread that hashes arriving chunks: in order (a FIFO with one worker), off the event
    loop (sha256 runs at ~1.7 GB/s: a GiB would stall the loop, and the session keepalives on
    it, for over half a second)."""
    global _hash_thread
    if _hash_thread is None:
        _hash_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-sha256")
    return _hash_thread


class _Arrival:
    """One version arriving over a stream: each chunk is copied once into a buffer of the
    manifest's size and hashed in order on a thread while the next one arrives. Memory: one
    model copy (the returned tensors are views of it where they can be)."""

    def __init__(self, manifest: trainer_pb2.WeightManifest) -> None:
        self.manifest = manifest
        try:
            self._pages = np.empty(manifest.total_bytes, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise WeightIntegrityError(
                f"version {manifest.version}: cannot hold {manifest.total_bytes} bytes: {exc}"
            ) from exc
        self.received = 0
        self._hasher = hashlib.sha256()
        self._hashed: asyncio.Future[None] | None = None

    def add(self, offset: int, data: bytes) -> None:
        if offset != self.received:
            raise WeightIntegrityError(f"chunk at offset {offset}, expected {self.received}")
        end = offset + len(data)
        if end > self.manifest.total_bytes:
            raise WeightIntegrityError(
                f"version {self.manifest.version}: a chunk ends at byte {end}, "
                f"past the manifest's {self.manifest.total_bytes}"
            )
        region = self._pages[offset:end]
        region[:] = np.frombuffer(data, dtype=np.uint8)
        self.received = end
        self._hashed = asyncio.get_running_loop().run_in_executor(
            _hashing(), self._hasher.update, region.data
        )

    async def finish(self) -> NamedTensors:
        if self._hashed is not None:
            await self._hashed  # the last update: the one thread ran the earlier ones before it
        _check_arrived(self.manifest, self.received, self._hasher.hexdigest())
        return _tensors_in(self.manifest, torch.from_numpy(self._pages))


class PullProgress:
    """How far one pull has come: the bytes received of the version's total, and from where.

    A pull that lasts longer than `every_s` logs `weights.pull_progress` that often, so a pull
    of a large model shows that it moves, how fast and from which holder; `gauges` gives the
    same figures for a role's status. Bytes are counted as they arrive, before their checksum:
    a bucket pulled again after a checksum failure or a lost source counts twice, so the count
    can pass the total.
    """

    def __init__(
        self,
        version: int,
        total_bytes: int,
        every_s: float = PULL_PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.version = version
        self.total_bytes = total_bytes
        self.every_s = every_s
        self.received_bytes = 0
        self.logged = 0  # progress lines written
        self._clock = clock
        self.started = clock()
        self._next_log = self.started + every_s

    def received(self, nbytes: int, source: str) -> None:
        """`nbytes` more arrived from `source`; log if the interval has passed."""
        self.received_bytes += nbytes
        now = self._clock()
        if now < self._next_log:
            return
        self._next_log = now + self.every_s
        self.logged += 1
        seconds = now - self.started
        log.info(
            "weights.pull_progress",
            version=self.version,
            received_bytes=self.received_bytes,
            total_bytes=self.total_bytes,
            percent=round(100 * self.received_bytes / max(self.total_bytes, 1), 1),
            seconds=round(seconds, 3),
            gb_per_s=round(self.received_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
            source=source,
        )

    def gauges(self) -> dict[str, float]:
        return _pull_gauges(self.version, self.received_bytes, self.total_bytes)


def _pull_gauges(version: int, received_bytes: int, total_bytes: int) -> dict[str, float]:
    return {
        "weights_pull_version": float(version),
        "weights_pull_received_bytes": float(received_bytes),
        "weights_pull_total_bytes": float(total_bytes),
    }


IDLE_PULL_GAUGES = _pull_gauges(0, 0, 0)
"""The pull gauges of a transport pulling nothing."""


class WeightTransport(ABC):
    """Trainer side: publish versions. Rollout side: fetch an announced version."""

    name: str
    pulling: PullProgress | None = None
    """The pull under way, if any (the latest one started, if a caller runs several)."""
    pulls_completed: int = 0

    @abstractmethod
    async def publish(self, version: int, tensors: NamedTensors) -> None:
        """Make `version` available and announce it in etcd. The transport copies what it
        serves before it returns: the caller's tensors may change afterwards."""

    @abstractmethod
    async def fetch(self, announcement: Announcement) -> NamedTensors:
        """Pull and verify the announced version; WeightIntegrityError if it is corrupt."""

    async def close(self) -> None:  # noqa: B027 - a transport may hold nothing to release
        """Stop serving and release what the transport holds. Idempotent."""

    def gauges(self) -> dict[str, float]:
        """Weight-plane figures for the role's status (`weights_*`): the pull under way, if
        any, and counts so far."""
        pulling = self.pulling
        return {
            **(pulling.gauges() if pulling is not None else IDLE_PULL_GAUGES),
            "weights_pulls": float(self.pulls_completed),
        }


class GrpcStreamTransport(WeightTransport):
    """Weights over a gRPC server stream from the trainer (`Trainer.PullWeights`)."""

    name = "grpc"

    def __init__(
        self, client: aetcd.Client, keys: KeySpace, job_id: str, *, address: str, epoch: int
    ) -> None:
        self.client = client
        self.keys = keys
        self.job_id = job_id
        self.address = address
        self.epoch = epoch
        self.progress_every_s = PULL_PROGRESS_EVERY_S
        self._held: dict[int, tuple[trainer_pb2.WeightManifest, bytes]] = {}

    async def publish(self, version: int, tensors: NamedTensors) -> None:
        # Packing copies and hashes the whole model: off the event loop.
        self._held[version] = await asyncio.to_thread(
            pack, self.job_id, version, self.epoch, tensors
        )
        # Keep the newest two: a puller that started on the previous version can finish.
        for old in sorted(self._held)[:-2]:
            del self._held[old]
        announcement = Announcement(self.job_id, version, self.address, self.epoch, self.name)
        await self.client.put(self.keys.weights(self.job_id), announcement.to_json())

    def serve(
        self, request: trainer_pb2.PullWeightsRequest
    ) -> AsyncIterator[trainer_pb2.WeightChunk]:
        """Chunks of a held version; FailedPrecondition when this trainer does not hold it."""
        if request.job_id != self.job_id or request.version not in self._held:
            held = sorted(self._held)
            raise FailedPrecondition(
                f"this trainer holds versions {held} of job {self.job_id}, "
                f"not version {request.version} of job {request.job_id}"
            )
        manifest, blob = self._held[request.version]

        async def chunks() -> AsyncIterator[trainer_pb2.WeightChunk]:
            yield trainer_pb2.WeightChunk(manifest=manifest, offset=0, data=blob[:CHUNK_BYTES])
            for offset in range(CHUNK_BYTES, len(blob), CHUNK_BYTES):
                yield trainer_pb2.WeightChunk(
                    offset=offset, data=blob[offset : offset + CHUNK_BYTES]
                )

        return chunks()

    async def fetch(self, announcement: Announcement) -> NamedTensors:
        request = trainer_pb2.PullWeightsRequest(
            job_id=announcement.job_id, version=announcement.version
        )
        arrival: _Arrival | None = None
        progress: PullProgress | None = None
        try:
            async with open_channel(announcement.address) as channel:
                stream = trainer_pb2_grpc.TrainerStub(channel).PullWeights(
                    request, timeout=PULL_DEADLINE
                )
                async for chunk in stream:
                    if arrival is None:
                        if not chunk.HasField("manifest"):
                            raise WeightIntegrityError("the first chunk carries no manifest")
                        manifest = chunk.manifest
                        if (
                            manifest.version != announcement.version
                            or manifest.trainer_epoch != announcement.trainer_epoch
                        ):
                            raise WeightIntegrityError(
                                "the manifest does not match the announcement"
                            )
                        arrival = _Arrival(manifest)
                        progress = self.pulling = PullProgress(
                            manifest.version, manifest.total_bytes, self.progress_every_s
                        )
                    arrival.add(chunk.offset, chunk.data)
                    assert progress is not None
                    progress.received(len(chunk.data), announcement.address)
            if arrival is None:
                raise WeightIntegrityError("the stream ended before the manifest")
            tensors = await arrival.finish()
        finally:
            if progress is not None and self.pulling is progress:
                self.pulling = None
        self.pulls_completed += 1
        return tensors


WeightStream = Callable[[trainer_pb2.PullWeightsRequest], AsyncIterator[trainer_pb2.WeightChunk]]


async def start_weight_server(serve: WeightStream) -> tuple[grpc.aio.Server, str]:
    """A gRPC server on a free loopback port with only Trainer.PullWeights, answered by
    `serve` (a GrpcStreamTransport's, as in the trainer): weights without a trainer, for the
    benchmark and tests. Returns the started server and its address."""

    async def pull_weights(
        request: trainer_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.WeightChunk]:
        async for chunk in serve(request):
            yield chunk

    handler = grpc.method_handlers_generic_handler(
        "robustrl.v1.Trainer",
        {
            "PullWeights": grpc.unary_stream_rpc_method_handler(
                pull_weights,
                request_deserializer=trainer_pb2.PullWeightsRequest.FromString,
                response_serializer=trainer_pb2.WeightChunk.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def latest_announcement(
    client: aetcd.Client, keys: KeySpace, job_id: str
) -> Announcement | None:
    raw = await client.get(keys.weights(job_id))
    return None if raw is None else Announcement.from_json(raw.value)
