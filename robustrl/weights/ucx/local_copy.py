"""A copy of one version from one holder at a known address, with no etcd.

For a process on the holder's host that must have exactly the version that holder has: a vLLM
worker takes the version its rollout pulled (and relays) this way, straight into its own memory.
There is no other holder to fall back on, so a copy that is not whole and verified raises, and
nothing of it may be used: every bucket is checked against the manifest as it lands.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

import torch

from robustrl.weights.checksums import LandedChecks
from robustrl.weights.protocol import BAD_REPLY, IN_FLIGHT_BUCKETS, BucketManifest, HolderRefused
from robustrl.weights.transport import PullProgress, WeightIntegrityError
from robustrl.weights.ucx.connections import HolderConnection, SourceGuard
from robustrl.weights.ucx.puller import PullTimings, receive_buckets


async def copy_from_holder(
    maker: Any,
    address: str,
    manifest: BucketManifest,
    buffer: torch.Tensor,
    *,
    pool: Executor,
    in_flight: int = IN_FLIGHT_BUCKETS,
    stall_timeout: float = 30.0,
) -> PullTimings:
    """Fill `buffer` (manifest.total_bytes, on any device) with every bucket of `manifest` from
    the holder at `address`, over an endpoint made by `maker` (the ucxx module or a context).

    Raises HolderRefused when the holder cannot serve the version, ConnectionError when it goes
    away or sends nothing for `stall_timeout` seconds, and WeightIntegrityError when a bucket
    does not match the manifest."""
    if buffer.numel() != manifest.total_bytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes for {manifest.total_bytes}")
    timings = PullTimings()
    progress = PullProgress(manifest.version, manifest.total_bytes)
    checks = LandedChecks(manifest.checksum_algorithm, pool)
    wanted = list(range(len(manifest.buckets)))
    try:
        conn = await HolderConnection.open(maker, address, stall_timeout)
        try:
            async with SourceGuard(conn, address, asyncio.Event(), stall_timeout) as guard:
                seq, sizes = await conn.request(
                    manifest.job_id, manifest.version, manifest.digest, wanted
                )
                if sizes != [(i, bucket.nbytes) for i, bucket in enumerate(manifest.buckets)]:
                    raise HolderRefused(BAD_REPLY, f"{address} offered other buckets: {sizes[:4]}")
                await receive_buckets(
                    conn, guard, manifest, buffer, seq, sizes, checks, timings, progress, in_flight
                )
        finally:
            await conn.close()
    except HolderRefused:
        raise
    except Exception as exc:  # the holder went away, stalled, or the endpoint broke
        raise ConnectionError(
            f"copy of version {manifest.version} from {address} failed after "
            f"{progress.received_bytes} of {manifest.total_bytes} bytes: {exc!r}"
        ) from exc
    bad = [i for i, digest in await checks.results() if digest != manifest.buckets[i].checksum]
    if bad:
        raise WeightIntegrityError(
            f"version {manifest.version} from {address}: buckets {bad[:8]} do not match the "
            f"manifest ({len(bad)} of {len(manifest.buckets)})"
        )
    return timings
