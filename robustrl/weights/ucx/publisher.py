"""Making a version servable: pack the tensors into one buffer, checksum its buckets, and write
the manifest with the announcement in etcd, fenced by trainer epoch.

The trainer packs its tensors (protocol.plan_layout, buffers.pack_into) into a buffer on their
device, checksums every bucket on a thread pool with the algorithm that suits that device
(checksums.algorithm_for) unless told one, and writes manifest and announcement in one
transaction that a newer trainer epoch's records refuse (Fenced). A relay that already has a
version's tensors packs them against the published manifest and must match it bucket for
bucket. A sharded trainer group publishes each version as shares (VersionShare): rank 0 writes
the manifest of every rank's checksums, and each rank holds and serves its own buckets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import aetcd
import torch

from robustrl.contracts.errors import Aborted, Fenced
from robustrl.contracts.keys import WeightKeys
from robustrl.core.logs import get_logger
from robustrl.weights.checksums import algorithm_for, bucket_checksum
from robustrl.weights.protocol import (
    BucketEntry,
    BucketManifest,
    TensorEntry,
    bucket_nbytes,
    manifest_for_etcd,
    plan_layout,
)
from robustrl.weights.transport import Announcement, NamedTensors, WeightIntegrityError
from robustrl.weights.ucx.buffers import HostBuffers, bucket_view, pack_into

log = get_logger(__name__)


@dataclass(frozen=True)
class VersionShare:
    """One rank's share of a version a sharded trainer group publishes: the layout every rank
    plans alike from the tensors' shapes (protocol.plan_layout), the checksum of every bucket
    (each rank hashes its own, and the group shares them), and this rank's buckets
    [first, stop) packed into `buffer` from the first one's offset on. No rank holds more
    of the version than its share."""

    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    bucket_bytes: int
    checksum_algorithm: str
    checksums: tuple[str, ...]
    first: int
    stop: int
    buffer: torch.Tensor

    def manifest(self, job_id: str, version: int, epoch: int) -> BucketManifest:
        spans = [
            (i * self.bucket_bytes, bucket_nbytes(i, self.bucket_bytes, self.total_bytes))
            for i in range(len(self.checksums))
        ]
        buckets = tuple(
            BucketEntry(i, o, n, h)
            for i, ((o, n), h) in enumerate(zip(spans, self.checksums, strict=True))
        )
        return BucketManifest(
            job_id,
            version,
            epoch,
            self.total_bytes,
            self.bucket_bytes,
            self.tensors,
            buckets,
            time.time(),
            self.checksum_algorithm,
        )


def _epoch_of(raw: bytes) -> int:
    """The trainer epoch of a manifest a publish would replace. One this release cannot read
    (an older release's format, left in etcd across an upgrade) is replaced: the announcement,
    written in the same transaction, still fences an older trainer."""
    try:
        return BucketManifest.from_json(raw).trainer_epoch
    except WeightIntegrityError as exc:
        log.warning("weights.manifest_replaced_unread", error=str(exc)[:200])
        return 0


class Publisher:
    """Packs, checksums and announces versions of one job for one trainer epoch."""

    def __init__(
        self,
        client: aetcd.Client,
        wkeys: WeightKeys,
        job_id: str,
        *,
        epoch: int,
        bucket_bytes: int,
        checksum_algorithm: str | None,
        pool: Executor,
        packs: HostBuffers,
    ) -> None:
        self._client = client
        self._wkeys = wkeys
        self._job_id = job_id
        self.epoch = epoch
        self.bucket_bytes = bucket_bytes
        self.checksum_algorithm = checksum_algorithm  # None: by device (algorithm_for)
        self._pool = pool
        self.packs = packs  # what versions are packed into: the held ones and the next

    async def pack(
        self, version: int, tensors: NamedTensors
    ) -> tuple[BucketManifest, torch.Tensor]:
        """The manifest of `tensors` as `version` and the buffer they are packed into."""
        entries, total, spans = plan_layout(tensors, self.bucket_bytes)
        device = tensors[0][1].device if tensors else torch.device("cpu")
        buffer = self.packs.take(total, device)
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
            self._job_id,
            version,
            self.epoch,
            total,
            self.bucket_bytes,
            entries,
            buckets,
            time.time(),
            algorithm,
        )
        return manifest, buffer

    async def pack_matching(self, manifest: BucketManifest, tensors: NamedTensors) -> torch.Tensor:
        """`tensors` packed as the published `manifest` lays them out; WeightIntegrityError
        unless they match it bucket for bucket."""
        version = manifest.version
        entries, total, _ = plan_layout(tensors, manifest.bucket_bytes)
        if entries != manifest.tensors or total != manifest.total_bytes:
            raise WeightIntegrityError(f"version {version}: tensors do not match the manifest")
        device = tensors[0][1].device if tensors else torch.device("cpu")
        buffer = self.packs.take(total, device)
        await asyncio.to_thread(pack_into, tensors, entries, buffer)
        hashes = await self._hash_buckets(manifest, buffer, range(len(manifest.buckets)))
        if any(h != b.checksum for h, b in zip(hashes, manifest.buckets, strict=True)):
            raise WeightIntegrityError(f"version {version}: tensors do not match the manifest")
        return buffer

    async def _hash_buckets(
        self, manifest: BucketManifest, buffer: torch.Tensor, indexes: Sequence[int] | range
    ) -> list[str]:
        loop = asyncio.get_running_loop()
        views = [bucket_view(manifest, buffer, i) for i in indexes]
        algorithm = manifest.checksum_algorithm
        hashes = await asyncio.gather(
            *(loop.run_in_executor(self._pool, bucket_checksum, v, algorithm) for v in views)
        )
        return list(hashes)

    async def write(
        self, manifest: BucketManifest, address: str, transport: str, attempts: int = 3
    ) -> int:
        """Write manifest and announcement (of `transport` at `address`) in one transaction
        unless a newer trainer epoch owns them (Fenced); the manifest's revision. Aborted if
        they keep changing under us; ManifestTooLarge, before any write, if etcd could not take
        it."""
        raw = manifest_for_etcd(manifest)
        client = self._client
        tx = client.transactions
        key = self._wkeys.manifest(self._job_id, manifest.version)
        ann_key = self._wkeys.announcement(self._job_id)
        announcement = Announcement(self._job_id, manifest.version, address, self.epoch, transport)
        for _ in range(attempts):
            current = await client.get(key)
            announced = await client.get(ann_key)
            newer = [
                _epoch_of(current.value) if current else 0,
                Announcement.from_json(announced.value).trainer_epoch if announced else 0,
            ]
            if max(newer) > self.epoch:
                raise Fenced(
                    f"job {self._job_id}: trainer epoch {max(newer)} publishes weights; "
                    f"this trainer has epoch {self.epoch}"
                )
            ok, responses = await client.transaction(
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
        raise Aborted(f"job {self._job_id}: the weight records kept changing while publishing")
