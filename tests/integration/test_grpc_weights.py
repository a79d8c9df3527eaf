"""The gRPC stream transport (fallback and baseline) through a real gRPC server and real etcd.

The server delegates Trainer.PullWeights to a real GrpcStreamTransport, as the trainer does;
the tampering cases rewrite its stream on the way out, as a broken or confused trainer would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from robustrl.contracts.keys import KeySpace
from robustrl.core.config import EtcdSettings
from robustrl.v1 import trainer_pb2
from robustrl.weights.grpc_stream import CHUNK_BYTES, GrpcStreamTransport, start_weight_server
from robustrl.weights.transport import (
    IDLE_PULL_GAUGES,
    PullProgress,
    WeightIntegrityError,
    latest_announcement,
)

JOB = "job-grpc"
Chunks = AsyncIterator[trainer_pb2.WeightChunk]


def model() -> list[tuple[str, torch.Tensor]]:
    """Several chunks' worth, with tensors at offsets their dtype does not divide (an odd bf16
    count before an int64), as the back-to-back gRPC layout produces."""
    g = torch.Generator().manual_seed(3)
    return [
        ("embed.weight", torch.randn(700, 1024, generator=g)),  # 2.7 MiB: three chunks
        ("norm.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("rope.index", torch.arange(12, dtype=torch.int64).reshape(3, 4)),
        ("head.weight", torch.randn(33, 7, generator=g).to(torch.float16)),
    ]


class Trainer:
    """A gRPC server whose PullWeights streams a real transport's chunks through `tamper`."""

    def __init__(self, transport: GrpcStreamTransport) -> None:
        self.transport = transport
        self.tamper: Callable[[Chunks], Chunks] = lambda chunks: chunks
        self.server: Any = None

    async def start(self) -> str:
        def serve(request: trainer_pb2.PullWeightsRequest) -> Chunks:
            return self.tamper(self.transport.serve(request))

        self.server, address = await start_weight_server(serve)
        return address


@pytest.fixture
async def trainer(etcd_client: Any, etcd_settings: EtcdSettings) -> AsyncIterator[Trainer]:
    keys = KeySpace(etcd_settings.prefix)
    transport = GrpcStreamTransport(etcd_client, keys, JOB, address="", epoch=4)
    server = Trainer(transport)
    transport.address = await server.start()
    await transport.publish(7, model())
    yield server
    await server.server.stop(None)


async def fetch(etcd_client: Any, etcd_settings: EtcdSettings) -> list[tuple[str, torch.Tensor]]:
    keys = KeySpace(etcd_settings.prefix)
    announcement = await latest_announcement(etcd_client, keys, JOB)
    assert announcement is not None and announcement.version == 7
    puller = GrpcStreamTransport(etcd_client, keys, JOB, address="", epoch=0)
    return await puller.fetch(announcement)


async def test_a_fetched_version_is_bitwise_identical(
    trainer: Trainer, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    got = await fetch(etcd_client, etcd_settings)
    assert [name for name, _ in got] == [name for name, _ in model()]
    for (_, want), (name, tensor) in zip(model(), got, strict=True):
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), name


def flip_a_byte(chunks: Chunks) -> Chunks:
    async def out() -> Chunks:
        async for chunk in chunks:
            if chunk.offset == CHUNK_BYTES:
                data = bytearray(chunk.data)
                data[100] ^= 0x10
                chunk.data = bytes(data)
            yield chunk

    return out()


def one_chunk_too_many(chunks: Chunks) -> Chunks:
    async def out() -> Chunks:
        end = 0
        async for chunk in chunks:
            end = chunk.offset + len(chunk.data)
            yield chunk
        yield trainer_pb2.WeightChunk(offset=end, data=b"\0" * 64)

    return out()


def skip_a_chunk(chunks: Chunks) -> Chunks:
    async def out() -> Chunks:
        async for chunk in chunks:
            if chunk.offset != CHUNK_BYTES:
                yield chunk

    return out()


def cut_short(chunks: Chunks) -> Chunks:
    async def out() -> Chunks:
        async for chunk in chunks:
            yield chunk
            return  # the stream ends cleanly after the first chunk

    return out()


def overstate_a_tensor(chunks: Chunks) -> Chunks:
    """A manifest whose checksum matches but whose last tensor reaches past the buffer."""

    async def out() -> Chunks:
        async for chunk in chunks:
            if chunk.HasField("manifest"):
                chunk.manifest.tensors[-1].nbytes += 7 * 2  # one more row of float16
                chunk.manifest.tensors[-1].shape[0] += 1
            yield chunk

    return out()


@pytest.mark.parametrize(
    ("tamper", "error"),
    [
        (flip_a_byte, "checksum mismatch"),
        (one_chunk_too_many, "past the manifest"),
        (skip_a_chunk, f"chunk at offset {2 * CHUNK_BYTES}, expected {CHUNK_BYTES}"),
        (cut_short, "bytes, the manifest says"),
        (overstate_a_tensor, "do not hold a float16 tensor of shape"),
    ],
)
async def test_a_broken_stream_is_refused_with_what_broke(
    trainer: Trainer,
    etcd_client: Any,
    etcd_settings: EtcdSettings,
    tamper: Callable[[Chunks], Chunks],
    error: str,
) -> None:
    trainer.tamper = tamper
    with pytest.raises(WeightIntegrityError, match=error):
        await fetch(etcd_client, etcd_settings)
    trainer.tamper = lambda chunks: chunks
    assert len(await fetch(etcd_client, etcd_settings)) == len(model())


async def test_a_fetch_counts_its_chunks_as_they_arrive_and_ends_idle(
    trainer: Trainer, etcd_client: Any, etcd_settings: EtcdSettings, monkeypatch: Any
) -> None:
    keys = KeySpace(etcd_settings.prefix)
    announcement = await latest_announcement(etcd_client, keys, JOB)
    assert announcement is not None
    puller = GrpcStreamTransport(etcd_client, keys, JOB, address="", epoch=0)
    seen: list[dict[str, float]] = []
    counted = PullProgress.received

    def received(progress: PullProgress, nbytes: int, source: str) -> None:
        counted(progress, nbytes, source)
        seen.append(puller.gauges())  # as each chunk is counted

    monkeypatch.setattr(PullProgress, "received", received)
    await puller.fetch(announcement)

    total = sum(t.numel() * t.element_size() for _, t in model())
    assert len(seen) == -(-total // CHUNK_BYTES) == 3
    assert all(g["weights_pull_version"] == 7 for g in seen)
    assert all(g["weights_pull_total_bytes"] == total for g in seen)
    got = [g["weights_pull_received_bytes"] for g in seen]
    assert got == [CHUNK_BYTES, 2 * CHUNK_BYTES, total]
    assert puller.gauges() == {**IDLE_PULL_GAUGES, "weights_pulls": 1.0}
    assert puller.pulling is None
