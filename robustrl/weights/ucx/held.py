"""The versions a process holds: verified copies it serves to other pullers, the trainer's
after it publishes, a relay's after it pulls. At most keep_versions of them; the oldest go
first, an older trainer epoch's before the newest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from robustrl.core.logs import get_logger
from robustrl.weights.protocol import BucketManifest
from robustrl.weights.ucx.buffers import bucket_view

log = get_logger(__name__)


@dataclass
class HeldVersion:
    """One held copy: the manifest it matches, the buffer that holds it, and its pullers."""

    manifest: BucketManifest
    buffer: torch.Tensor
    role: str  # protocol.ROLE_TRAINER or ROLE_RELAY
    manifest_revision: int  # mod revision of the manifest key this copy matches
    active_pullers: int = 0
    recorded_pullers: int = 0  # the count our etcd record has
    first_bucket: int = 0
    stop_bucket: int | None = None
    """A share of the version: buckets [first_bucket, stop_bucket), `buffer` holding their
    bytes from the first one's offset on (a rank of a sharded trainer group). None: whole."""

    @property
    def whole(self) -> bool:
        return self.first_bucket == 0 and self.stop_bucket in (None, len(self.manifest.buckets))

    def holds(self, index: int) -> bool:
        stop = len(self.manifest.buckets) if self.stop_bucket is None else self.stop_bucket
        return self.first_bucket <= index < stop

    def bucket(self, index: int) -> torch.Tensor:
        if self.first_bucket == 0:
            return bucket_view(self.manifest, self.buffer, index)
        base = self.manifest.buckets[self.first_bucket].offset
        bucket = self.manifest.buckets[index]
        return self.buffer[bucket.offset - base : bucket.offset - base + bucket.nbytes]


def _keep_none(version: int) -> None:
    """A dropped version needs nothing more (until the transport says otherwise)."""


class HeldVersions:
    """The versions this process holds, by version. `on_drop` hears of each version dropped
    (the transport withdraws its holder record then)."""

    def __init__(self, keep: int, job_id: str) -> None:
        self.keep = keep
        self._job_id = job_id
        self._held: dict[int, HeldVersion] = {}
        self.on_drop: Callable[[int], None] = _keep_none

    def __contains__(self, version: int) -> bool:
        return version in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, version: int) -> HeldVersion | None:
        return self._held.get(version)

    def add(self, version: int, held: HeldVersion) -> None:
        self._held[version] = held

    def versions(self) -> list[int]:
        return sorted(self._held)

    def manifest_revisions(self) -> dict[int, int]:
        """Each held version and the revision of the manifest its copy matches."""
        return {version: held.manifest_revision for version, held in self._held.items()}

    def drop(self, version: int, reason: str) -> None:
        if self._held.pop(version, None) is not None:
            log.info("weights.dropped", job=self._job_id, version=version, reason=reason)
            self.on_drop(version)

    def prune(self) -> None:
        """Drop what is held beyond keep_versions."""
        for version in self._oldest_first()[: -self.keep]:
            self.drop(version, "superseded")

    def make_room(self) -> None:
        """Before a relay pulls: drop what it holds beyond keep_versions - 1, so the pull can
        receive into the buffer of the version dropped (once no transfer and no caller uses
        it). A rollout (keep_versions=1) stages one model copy, not the one it relays plus the
        one it pulls. What it dropped is superseded: its peers pull the new version too, and
        the trainer keeps two."""
        excess = len(self._held) - (self.keep - 1)
        for version in self._oldest_first()[: max(excess, 0)]:
            self.drop(version, "superseded")

    def clear(self) -> None:
        """Forget every copy at once, as the transport closes (no record is withdrawn: the
        session's lease takes them)."""
        self._held.clear()

    def _oldest_first(self) -> list[int]:
        """Held versions, the first to drop first: an older trainer epoch's before the newest
        (a restored trainer went back to its checkpoint's version), then by version."""
        return sorted(self._held, key=lambda v: (self._held[v].manifest.trainer_epoch, v))
