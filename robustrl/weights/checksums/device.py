"""What the on-device checksums (wsum128, imm128) share: the shape of such an algorithm, its
splitmix64 tables cached per device, and a CUDA stream of each thread's own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceAlgorithm:
    """A checksum that torch computes on the bucket's own device: sums queued there (not
    waited for), then a digest made from them on the host."""

    sums: Callable[[torch.Tensor], torch.Tensor]
    """One bucket's sums, as int64 on its device."""
    run_sums: Callable[[list[torch.Tensor]], torch.Tensor]
    """[buckets, sums] of a run of buckets that lie back to back in memory, each of the
    first one's size but the last."""
    ready: Callable[[torch.Tensor], bool]
    """Whether this bucket's sums can be queued at once: nothing to compile or make first
    (making a kernel or a table takes 0.1-1 s of host time, once per process and device)."""
    digest: Callable[[list[int]], str]
    """The hex digest of one bucket's sums."""


def splitmix(count: int, offset: int = 0) -> np.ndarray:
    """splitmix64's finaliser over positions offset+1 .. offset+count (uint64)."""
    with np.errstate(over="ignore"):
        x = np.arange(offset + 1, offset + count + 1, dtype=np.uint64)
        x *= np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


class PrefixCache:
    """Per device, the longest table `make(length)` made so far, along `dim`; prefixes serve
    shorter buckets. Made on the host with numpy's wrapping uint64 arithmetic, so every device
    gets bit-identical values."""

    def __init__(self, make: Callable[[int], torch.Tensor], dim: int) -> None:
        self._make = make
        self._dim = dim
        self._lock = threading.Lock()
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def ready(self, length: int, device: torch.device) -> bool:
        with self._lock:
            known = self._by_device.get(device)
            return known is not None and known.shape[self._dim] >= length

    def get(self, length: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            known = self._by_device.get(device)
            if known is None or known.shape[self._dim] < length:
                known = self._make(length).to(device)
                self._by_device[device] = known
        return known.narrow(self._dim, 0, length)


_streams = threading.local()


def own_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """On a GPU, a stream of this thread's own, not the legacy default stream, so the kernels
    neither wait for nor hold up the copies UCX runs on its streams (a bucket arrived whole
    before anyone checksums it: a UCX receive completes only after its copy). Nothing on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    by_device: dict[torch.device, torch.cuda.Stream] = _streams.__dict__.setdefault("by_device", {})
    if device not in by_device:
        by_device[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(by_device[device])
