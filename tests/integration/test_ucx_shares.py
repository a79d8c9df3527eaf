"""A version published as shares, as a sharded trainer group publishes it: each rank holds only
its range of the buckets, rank 0 writes the manifest of every rank's checksums, and a puller
takes each range from the rank that holds it. Real UCX endpoints and a real etcd."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from robustrl.contracts.errors import Fenced
from robustrl.contracts.keys import KeySpace
from robustrl.core.config import EtcdSettings
from robustrl.weights.checksums import XXH3_128, bucket_checksum
from robustrl.weights.protocol import (
    NO_SUCH_BUCKET,
    HolderRecord,
    HolderRefused,
    bucket_share,
    plan_layout,
)
from robustrl.weights.transport import NamedTensors
from robustrl.weights.ucx.buffers import pack_into
from robustrl.weights.ucx.connections import HolderConnection
from robustrl.weights.ucx.directory import WeightUnavailable
from robustrl.weights.ucx.publisher import VersionShare
from robustrl.weights.ucx.transport import UcxTransport
from tests.support.ucx_peer import make_tensors, tensors_digest

JOB = "job-shares"
BUCKET = 64 << 10


def shares_of(tensors: NamedTensors, world_size: int) -> list[VersionShare]:
    """Each rank's share of `tensors` as one version, cut as the ranks cut it."""
    entries, total, spans = plan_layout(tensors, BUCKET)
    whole = torch.empty(total, dtype=torch.uint8)
    pack_into(tensors, entries, whole)
    sums = tuple(bucket_checksum(whole[o : o + n], XXH3_128) for o, n in spans)
    out = []
    for rank in range(world_size):
        first, stop = bucket_share(len(spans), rank, world_size)
        lo = first * BUCKET
        hi = min(stop * BUCKET, total) if stop > first else lo
        out.append(
            VersionShare(entries, total, BUCKET, XXH3_128, sums, first, stop, whole[lo:hi].clone())
        )
    return out


def test_buckets_are_shared_out_in_contiguous_ranges_that_cover_the_version() -> None:
    assert [bucket_share(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [bucket_share(1, r, 2) for r in range(2)] == [(0, 0), (0, 1)]
    with pytest.raises(ValueError, match="outside a world of 2"):
        bucket_share(4, 2, 2)
    whole = HolderRecord("h", "a", "trainer", 1, "d")
    assert whole.holds(10**6)  # no range: every bucket
    assert b"bucket" not in whole.to_json()  # as a record read before ranges existed
    assert HolderRecord.from_json(whole.to_json()) == whole
    part = HolderRecord("h", "a", "trainer", 1, "d", first_bucket=3, stop_bucket=6)
    assert [part.holds(i) for i in (2, 3, 5, 6)] == [False, True, True, False]
    assert HolderRecord.from_json(part.to_json()) == part


async def test_a_version_published_as_shares_is_pulled_range_by_range_from_its_ranks(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    keys = KeySpace(etcd_settings.prefix)
    ranks = [
        UcxTransport(etcd_client, keys, JOB, instance_id=f"rank-{r}", epoch=1, relay=False)
        for r in range(2)
    ]
    puller = UcxTransport(etcd_client, keys, JOB, instance_id="rollout", relay=False)
    for transport in (*ranks, puller):
        await transport.start()
    try:
        tensors = make_tensors(5)
        shares = shares_of(tensors, 2)
        # Rank 1 waits for rank 0's manifest (it may come first or second).
        await asyncio.gather(
            ranks[1].hold_share(7, shares[1], timeout=10), ranks[0].publish_share(7, shares[0])
        )
        for rank, transport in enumerate(ranks):
            assert transport.held_versions() == [7]
            assert transport.local_source(7) is None  # a share is not a whole copy
            held = transport.held.get(7)
            assert held is not None and not held.whole
            assert held.buffer.numel() == shares[rank].buffer.numel()
        pulled = await puller.pull(JOB, 7)
        assert tensors_digest(pulled) == tensors_digest(tensors)
        counts = dict(puller.counters.buckets_by_source)
        assert counts == {
            "rank-0": shares[0].stop - shares[0].first,
            "rank-1": shares[1].stop - shares[1].first,
        }
        assert min(counts.values()) > 3
    finally:
        for transport in (puller, *ranks):
            await transport.close()


async def test_a_share_nobody_holds_leaves_the_pull_waiting_then_failing_clearly(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """Rank 1 never holds its share (it died before the manifest came): a puller takes rank
    0's range and gives up on the rest at pull_timeout, naming what is left. A rank asked for
    buckets outside its range refuses them (no_such_bucket) and serves on."""
    keys = KeySpace(etcd_settings.prefix)
    rank_0 = UcxTransport(etcd_client, keys, JOB, instance_id="rank-0", epoch=1, relay=False)
    puller = UcxTransport(etcd_client, keys, JOB, instance_id="rollout", pull_timeout=2)
    for transport in (rank_0, puller):
        await transport.start()
    try:
        shares = shares_of(make_tensors(6), 2)
        await rank_0.publish_share(3, shares[0])
        left = len(shares[0].checksums) - shares[0].stop
        with pytest.raises(
            WeightUnavailable, match=f"{left} of {len(shares[0].checksums)} buckets left"
        ):
            await puller.pull(JOB, 3)
        assert puller.counters.buckets_by_source["rank-0"] == shares[0].stop
        assert puller.counters.refusals == 0  # it never asked rank 0 for what it lacks

        held = rank_0.held.get(3)
        assert held is not None
        conn = await HolderConnection.open(puller.endpoints_for_pulls(), rank_0.address, 5.0)
        try:
            with pytest.raises(HolderRefused) as refused:
                await conn.request(JOB, 3, held.manifest.digest, [shares[0].stop])
            assert refused.value.code == NO_SUCH_BUCKET
            assert f"holds buckets 0..{shares[0].stop - 1} of version 3" in refused.value.message
        finally:
            await conn.close()
        # The same holder serves its own range on.
        again = UcxTransport(etcd_client, keys, JOB, instance_id="again", pull_timeout=0.5)
        await again.start()
        try:
            with pytest.raises(WeightUnavailable):
                await again.pull(JOB, 3)
            assert again.counters.buckets_by_source["rank-0"] == shares[0].stop
        finally:
            await again.close()
    finally:
        for transport in (puller, rank_0):
            await transport.close()


async def test_a_rank_holds_its_share_only_under_its_own_epochs_manifest(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """No manifest within the wait: WeightUnavailable. The version's manifest written by a
    newer epoch (the group was replaced): Fenced, and nothing is held."""
    keys = KeySpace(etcd_settings.prefix)
    old = UcxTransport(etcd_client, keys, JOB, instance_id="old-1", epoch=1, relay=False)
    new = UcxTransport(etcd_client, keys, JOB, instance_id="new-0", epoch=2, relay=False)
    for transport in (old, new):
        await transport.start()
    try:
        shares = shares_of(make_tensors(7), 2)
        with pytest.raises(WeightUnavailable, match="rank 0 wrote no manifest"):
            await old.hold_share(4, shares[1], timeout=0.3)
        await new.publish_share(4, shares[0])
        with pytest.raises(Fenced, match="trainer epoch 2 published version 4"):
            await old.hold_share(4, shares[1], timeout=5)
        assert old.held_versions() == []
    finally:
        for transport in (old, new):
            await transport.close()
