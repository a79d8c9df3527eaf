"""The gRPC stream transport: weights over a server stream from the trainer
(`Trainer.PullWeights`), the fallback when UCX cannot run and the benchmark's baseline.

The trainer packs a version into one buffer, tensors back to back in manifest order (name,
dtype, shape, offset, size), and records the sha256 of the whole buffer in trainer.proto's
WeightManifest. The stream's first chunk carries that manifest, every chunk its offset; a
puller copies each chunk once into a buffer of the manifest's size, hashes it in order on a
thread while the next arrives, and hands out tensors only once size and checksum match.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import aetcd
import grpc
import numpy as np
import torch

from robustrl.contracts.errors import FailedPrecondition
from robustrl.contracts.keys import KeySpace
from robustrl.core.channels import open_channel
from robustrl.v1 import trainer_pb2, trainer_pb2_grpc
from robustrl.weights.transport import (
    PULL_PROGRESS_EVERY_S,
    Announcement,
    NamedTensors,
    PullProgress,
    WeightIntegrityError,
    WeightTransport,
)

CHUNK_BYTES = 1 << 20
PULL_DEADLINE = 120.0


def pack(
    job_id: str, version: int, trainer_epoch: int, tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[trainer_pb2.WeightManifest, bytes]:
    """The manifest of `tensors` as `version`, and the buffer that holds them back to back."""
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
    loop (hashing a GiB there would stall the loop, and the session keepalives on it, for over
    half a second: docs/decisions/0101)."""
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
