"""Packing weight versions: bitwise round trip; corruption is caught before loading. Which
watched manifest events take a held version away."""

from __future__ import annotations

import pytest
import torch

from robustrl.core.watch import Delete, Entry, Put
from robustrl.weights import transport as weights
from robustrl.weights.grpc_stream import pack, unpack
from robustrl.weights.transport import PullProgress, WeightIntegrityError
from robustrl.weights.ucx.directory import changes_held_manifest


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 4, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.index", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]


def test_round_trip_is_bitwise_identical() -> None:
    manifest, blob = pack("j", 3, 1, tensors())
    assert manifest.version == 3 and manifest.total_bytes == len(blob)
    out = unpack(manifest, blob)
    for (name, want), (got_name, got) in zip(tensors(), out, strict=True):
        assert name == got_name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_a_flipped_byte_or_a_short_buffer_is_rejected() -> None:
    manifest, blob = pack("j", 1, 1, tensors())
    corrupt = bytearray(blob)
    corrupt[7] ^= 0xFF
    with pytest.raises(WeightIntegrityError, match="checksum"):
        unpack(manifest, bytes(corrupt))
    with pytest.raises(WeightIntegrityError, match="bytes"):
        unpack(manifest, blob[:-1])


def test_only_a_later_write_or_delete_of_the_manifest_takes_a_held_version_away() -> None:
    def put(revision: int) -> Put:
        return Put(Entry(b"/w/manifest", b"{}", 5, revision, 0))

    held = 12  # the revision our publish wrote (or our pull read)
    # Our own earlier write of it, which timed out and landed anyway before the retry wrote
    # revision 12: its event may come after we hold 12, and must not drop it.
    assert not changes_held_manifest(held, put(11))
    assert not changes_held_manifest(held, put(held))
    assert not changes_held_manifest(held, Delete(b"/w/manifest", 9))  # an older incarnation's
    assert changes_held_manifest(held, put(13))  # re-published by a newer trainer epoch
    assert changes_held_manifest(held, Delete(b"/w/manifest", 13))  # garbage-collected


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))


def test_a_long_pull_logs_its_progress_once_an_interval_and_its_gauges_follow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = _Lines()
    monkeypatch.setattr(weights, "log", lines)
    clock = _Clock()
    gb = 1_000_000_000
    progress = PullProgress(7, 4 * gb, every_s=5.0, clock=clock)

    clock.now += 1.0
    progress.received(gb, "trainer")  # 1 s in: too soon to log
    assert lines.lines == [] and progress.gauges() == {
        "weights_pull_version": 7.0,
        "weights_pull_received_bytes": 1e9,
        "weights_pull_total_bytes": 4e9,
    }
    clock.now += 4.0
    progress.received(gb, "trainer")  # 5 s in
    clock.now += 1.0
    progress.received(gb, "relay-2")  # 6 s in: within the next interval
    clock.now += 4.5
    progress.received(3 * gb // 2, "relay-2")  # 10.5 s in: buckets pulled twice count twice

    assert [event for event, _ in lines.lines] == ["weights.pull_progress"] * 2
    first, second = (fields for _, fields in lines.lines)
    assert first == {
        "version": 7,
        "received_bytes": 2 * gb,
        "total_bytes": 4 * gb,
        "percent": 50.0,
        "seconds": 5.0,
        "gb_per_s": 0.4,
        "source": "trainer",
    }
    assert second["received_bytes"] == 9 * gb // 2 and second["percent"] == 112.5
    assert second["source"] == "relay-2" and second["seconds"] == 10.5
    assert progress.logged == 2


def test_a_transport_pulling_nothing_reports_idle_pull_gauges() -> None:
    class Idle(weights.WeightTransport):
        name = "idle"

        async def publish(self, version: int, tensors: weights.NamedTensors) -> None:
            raise NotImplementedError

        async def fetch(self, announcement: weights.Announcement) -> weights.NamedTensors:
            raise NotImplementedError

    transport = Idle()
    assert transport.gauges() == {**weights.IDLE_PULL_GAUGES, "weights_pulls": 0.0}
    transport.pulling = PullProgress(3, 10, clock=_Clock())
    assert transport.gauges()["weights_pull_version"] == 3.0
