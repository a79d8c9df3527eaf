"""wsum128: two position-weighted sums of a bucket's 32-bit words, on the bucket's own device.

Word i (int32; a ragged tail zero-padded into one more word) is multiplied by two coefficients,
the low and high halves of splitmix64(i + 1), each made odd; the int32 products wrap mod 2^32,
and each of the two sums is their exact sum, mod 2^64. The digest is both sums, 16 hex digits
each. Integer arithmetic only: the same bytes give the same digest on any device.

Every change confined to one word is caught for certain (a nonzero word difference times an
odd coefficient is nonzero mod 2^32); larger changes pass only by an accidental 128-bit match.

On a GPU one Triton kernel computes both sums (wsum_triton.py), once it has given torch's sums
on a probe on that device (`kernel`); elsewhere, or with ROBUSTRL_WSUM_KERNEL=torch, torch's
kernels multiply by a coefficient table cached per device.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import torch

from robustrl.core.logs import get_logger
from robustrl.weights.checksums.device import DeviceAlgorithm, PrefixCache, own_stream, splitmix

log = get_logger(__name__)

NAME = "wsum128"

# Words summed per kernel launch (a 32 MiB bucket is one launch): bounds the temporary, the
# products, at 8 bytes a word.
_CHUNK_WORDS = 1 << 23
_MASK64 = (1 << 64) - 1

# wsum_triton.wsum128_sums: (words, words per bucket) -> [buckets, 2].
Kernel = Callable[[torch.Tensor, int], torch.Tensor]
# Per CUDA device: wsum_triton's kernel once it has given torch's sums on a probe there, or
# None where it may not be used (no triton, turned off, or it failed the probe).
_kernels: dict[torch.device, Kernel | None] = {}
_kernels_lock = threading.Lock()
# Probe: several buckets of many programs each, the last bucket and each bucket's last
# program ragged.
_PROBE_WORDS = (1 << 20) + 5
_PROBE_BUCKET_WORDS = (1 << 18) + 3


def checksum(view: torch.Tensor) -> str:
    """The hex digest of one bucket (a flat uint8 tensor on any device), computed there on
    this thread's stream."""
    with own_stream(view.device):
        return digest(sums(view).tolist())


def sums(view: torch.Tensor) -> torch.Tensor:
    """The two sums as an int64 tensor [2] on the bucket's device (queued, not waited for)."""
    words = as_words(view)
    if words.device.type == "cuda":
        found = kernel(words.device)
        if found is not None:
            return found(words, words.numel())[0]
    return _torch_sums(words)


def run_sums(views: list[torch.Tensor]) -> torch.Tensor:
    """[buckets, 2] for a run of back-to-back buckets, queued on the current stream: one launch
    of the kernel where it has been checked on their device."""
    first = views[0]
    found = _kernels.get(first.device)
    if found is None or len(views) == 1:
        return torch.stack([sums(view) for view in views])
    span = sum(view.numel() for view in views)
    words = first.as_strided((span,), (1,)).view(torch.int32)
    return found(words, first.numel() // 4)


def ready(view: torch.Tensor) -> bool:
    """Whether the bucket's sums can be queued at once: the kernel checked, or the table made."""
    return _kernels.get(view.device) is not None or _coefficients.ready(
        (view.numel() + 3) // 4, view.device
    )


def digest(pair: list[int]) -> str:
    low, high = pair
    return f"{low & _MASK64:016x}{high & _MASK64:016x}"


ALGORITHM = DeviceAlgorithm(sums=sums, run_sums=run_sums, ready=ready, digest=digest)


def _torch_sums(words: torch.Tensor) -> torch.Tensor:
    coefficients = _coefficients.get(words.numel(), words.device)  # [2, words]
    chunks = [
        # int32 products wrap mod 2^32; their int64 sum over a chunk is exact. Few kernels per
        # bucket matter: each launch holds the GIL the event loop needs.
        (words[start : start + _CHUNK_WORDS] * coefficients[:, start : start + _CHUNK_WORDS]).sum(
            dim=1, dtype=torch.int64
        )
        for start in range(0, words.numel(), _CHUNK_WORDS)
    ]
    if not chunks:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    return torch.stack(chunks).sum(dim=0)


def kernel(device: torch.device) -> Kernel | None:
    """wsum_triton's kernel for `device`, checked on first use there (compiling it takes a
    second or so), or None to use torch's kernels. ROBUSTRL_WSUM_KERNEL=torch turns it off."""
    if device in _kernels:
        return _kernels[device]
    with _kernels_lock:
        if device not in _kernels:
            _kernels[device] = _checked_kernel(device)
        return _kernels[device]


def _checked_kernel(device: torch.device) -> Kernel | None:
    if os.environ.get("ROBUSTRL_WSUM_KERNEL", "triton") == "torch":
        return None
    try:
        from robustrl.weights.checksums import wsum_triton
    except ImportError as exc:
        log.info("checksums.wsum128_kernel_unavailable", device=str(device), error=str(exc))
        return None
    generator = torch.Generator().manual_seed(128)
    probe = torch.randint(
        -(1 << 31), 1 << 31, (_PROBE_WORDS,), dtype=torch.int64, generator=generator
    )
    probe = probe.to(torch.int32).to(device)
    try:
        got = wsum_triton.wsum128_sums(probe, _PROBE_BUCKET_WORDS).tolist()
    except Exception as exc:  # a kernel that cannot compile or run here: torch's kernels do
        log.warning("checksums.wsum128_kernel_failed", device=str(device), error=repr(exc))
        return None
    wanted = [
        _torch_sums(probe[start : start + _PROBE_BUCKET_WORDS]).tolist()
        for start in range(0, _PROBE_WORDS, _PROBE_BUCKET_WORDS)
    ]
    if got != wanted:
        log.error("checksums.wsum128_kernel_mismatch", device=str(device), got=got, wanted=wanted)
        return None
    log.info("checksums.wsum128_kernel_ready", device=str(device))
    checked: Kernel = wsum_triton.wsum128_sums
    return checked


def as_words(view: torch.Tensor) -> torch.Tensor:
    """The bucket as int32 words; a ragged tail is zero-padded into one more word (the bucket's
    length is checked on its own, so the padding cannot hide a short transfer)."""
    flat = view.reshape(-1)
    whole = flat.numel() - flat.numel() % 4
    if flat.storage_offset() % 4 or whole != flat.numel():
        padded = torch.zeros(
            whole + 4 * (whole != flat.numel()), dtype=torch.uint8, device=flat.device
        )
        padded[: flat.numel()] = flat
        flat = padded
    return flat.view(torch.int32)


def _make_coefficients(words: int) -> torch.Tensor:
    """[2, words] int32: the low and high halves of each position's splitmix, odd."""
    x = splitmix(words)
    low = (x & np.uint64(0xFFFFFFFF)).astype(np.uint32) | np.uint32(1)
    high = (x >> np.uint64(32)).astype(np.uint32) | np.uint32(1)
    return torch.from_numpy(np.stack([low, high]).view(np.int32))


_coefficients = PrefixCache(_make_coefficients, dim=1)
