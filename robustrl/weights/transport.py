"""The weight transport interface: what every way of moving weights offers, and shares.

The trainer publishes version V of its weights and announces `<prefix>/weights/<job_id>` =
{version, address, trainer_epoch, transport} in etcd (`Announcement`). A rollout that sees a
newer version fetches it, and the transport verifies what arrived before it hands the tensors
over, so a corrupt or partial transfer is never loaded.

`WeightTransport` is the seam: the UCX transport (ucx/transport.py) and the gRPC stream
(grpc_stream.py, the fallback and the benchmark's baseline) plug in behind the same calls.
This module needs torch: the coordinator and monitor never import it.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import aetcd
import torch

from robustrl.contracts.keys import KeySpace
from robustrl.core.logs import get_logger

log = get_logger(__name__)

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


@dataclass(frozen=True)
class LocalSource:
    """Where another process on this host can copy a version this transport holds from: its
    UCX holder's address and the version's manifest (JSON)."""

    version: int
    address: str
    manifest: bytes


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

    def local_source(self, version: int) -> LocalSource | None:
        """Where a process on this host can copy `version` from, if this transport serves it
        (None: it does not; the caller hands the tensors over itself)."""
        return None

    def gauges(self) -> dict[str, float]:
        """Weight-plane figures for the role's status (`weights_*`): the pull under way, if
        any, and counts so far."""
        pulling = self.pulling
        return {
            **(pulling.gauges() if pulling is not None else IDLE_PULL_GAUGES),
            "weights_pulls": float(self.pulls_completed),
        }


async def latest_announcement(
    client: aetcd.Client, keys: KeySpace, job_id: str
) -> Announcement | None:
    """The job's announcement in etcd, or None before its first publish."""
    raw = await client.get(keys.weights(job_id))
    return None if raw is None else Announcement.from_json(raw.value)
