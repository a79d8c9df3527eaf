"""Packing weight versions: bitwise round trip; corruption is caught before loading. Which
watched manifest events take a held version away."""

from __future__ import annotations

import pytest
import torch

from services.common.ucx_transport import changes_held_manifest
from services.common.watch import Delete, Entry, Put
from services.common.weights import WeightIntegrityError, pack, unpack


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
