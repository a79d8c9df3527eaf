"""Bucket checksums for the weight plane: one name per algorithm, computed where the bytes are.

A manifest names the algorithm its bucket checksums were made with; every puller verifies with
that one, on whatever device its copy lives:

    xxh3_128   xxhash's xxh3, 128 bits, on the host. ~30 GB/s a core. A CUDA copy must come
               back to the host to be hashed (measured on an H100: 1.3 GB/s, against 85-300
               GB/s for the GPU-to-GPU transfer itself).
    wsum128    two position-weighted sums of the bucket's 32-bit words, in torch, on the
               bucket's own device: a CUDA bucket is verified without leaving the GPU. The
               same bytes give the same digest on any device (integer arithmetic only).
    imm128     the bucket as int8 rows of 4 KiB times a fixed int8 matrix [4096, 8]
               (torch._int_mm, tensor cores on a GPU), each product weighted by its row: one
               pass over the bucket, where wsum128's torch kernels move about 16 bytes per
               byte (below). Same bytes, same digest on any device. Opt-in
               (`trainer.weight_checksum`): run on CPU only so far (11.6 GB/s warm on this
               2-core VM, against xxh3's 32), not yet on a GPU.

A publisher picks by where its packed buffer lives (`algorithm_for`), unless told one. A puller
checks each bucket as it lands (`checksum_landed`): a host bucket under xxh3 on the event loop's
own thread, anything else in a thread pool. Within one host UCX copies the bytes inside the
progress call of the receiving worker (CMA's process_vm_readv). On hosts without CUDA a puller's
worker is progressed by a thread of its own (ucx_progress.pull_context), so the next bucket
copies while the loop hashes the last. With ROBUSTRL_UCX_PULL_THREAD=0 (and in the experiments
below but the last) the event loop progresses the worker: the copy runs on the loop's thread but
without the GIL, and xxh3 releases it too, so a pool thread could hash one bucket while the next
one copies. That bought nothing: copy and hash both stream memory and share its bandwidth (xxh3
reads a 32 MiB bucket at 30-44 GB/s from cache, 8-9 GB/s from DRAM, on 2 cores). Measured side
by side on 2 cores, pulls with the hash inline, on the bucket just landed, were 20-35% faster in
one run and level with the pool in another, and inline costs no thread hand-off per bucket.
Hashing each bucket in 1-8 MiB frames as they land (each frame its own message, one streaming
xxh3 per bucket), in the hope of reading them from cache, was no faster either: in one run at
64-256 MiB, 0.68-0.78 of plain ucxx inline and 0.46-0.73 in a pool, against 0.72-0.80 for whole
buckets inline. Nor was keeping fewer frames in flight, so that each is hashed before later
copies push it out of cache: 256 MiB in 2-16 MiB frames with 1, 2 or 4 in flight, inline or on
one pool thread, reached 0.63-0.73 of plain ucxx, against 0.66 inline and 0.68 pooled for whole
32 MiB buckets in the same run (median of 7, 2 cores). Inline, even a hash from cache adds its
time to the copy's; why the pool overlaps so little was not found. With the copy on the pulling
thread, frames were no better: plain ucxx into a verified receive on that worker, 256 MiB in 2,
4 or 8 MiB frames reached 0.67, 0.75 and 0.78 of plain ucxx, whole 32 MiB buckets 0.80; whole
buckets at 64 MiB 0.72 and at 1 GiB 1.03, and 16 MiB buckets the same (median of 7, 2 cores, one
run).

Why a verified pull on the loop's thread stays near two thirds of plain ucxx: copy and hash
take turns on one core, so their rates add as 1/(1/copy + 1/hash). Measured here (2 cores,
32 MiB buckets): a copy at 19.6 GB/s and xxh3 at ~34 GB/s give 12.5 GB/s, 0.64 of the copy
alone. Two more ways round it were tried and dropped. Hashing the bucket in 1-8 MiB frames,
last frame first, to catch what the copy left in cache: 0.60-0.61, against 0.64 for the whole
bucket. UCX's put scheme (UCX_RNDV_SCHEME=put_zcopy, the holder's process writes into the
puller's buffer, so the copy moves to the holder's core): the hash then overlapped (verified
0.86-0.87 of plain ucxx under the same scheme), but the holder copied at 12.6 GB/s against
the puller's 16.2, and verified pulls came out at 10.9 GB/s either way (256 MiB, median of
5). Only a second core copying beside the hash, with the copy as fast as the puller's own,
gets past the bound: the pulling thread does. Transparent huge pages for the buffers
(madvise MADV_HUGEPAGE; this host's THP mode is madvise) were tried too, to spare the TLB:
process_vm_readv of 256 MiB fell from 17-18 GB/s to 6.5-7.0, and xxh3 was no faster (30
against 31.5 GB/s).

On a GPU, wsum128 is what bounds a verified pull. Measured on an H200 (16 cores, one run each):
its kernels ran at 180-200 GB/s, warm, on 32-256 MiB buckets: torch's product and its int64
sum pass over memory several times (about 16 bytes moved per byte checksummed if the sum casts
the products to int64 first, which fits the time; not profiled). Plain ucxx copied
64 MiB-1 GiB between two processes on that one GPU at 110-690 GB/s, and verified pulls reached
29-75 GB/s with 32 MiB buckets and 34-116 GB/s with 256 MiB ones (0.15-0.30 of plain ucxx). A
kernel that reads each word once and makes its coefficients in registers would lift that bound.
It is not written: it could not be measured on a GPU here. imm128 is the way round it with
stock kernels (an int8 matrix product reads each byte once); it waits for a GPU to be measured
against wsum128 (`benchmarks/weight_transfer.py --device cuda --checksum imm128`).

No algorithm here is a defence against an adversary (see ucx_transport); all catch flipped
bits, torn, misplaced and reordered transfers. wsum128 catches every change confined to one
32-bit word for certain (each coefficient is odd, so a nonzero word difference times it is
nonzero mod 2^32); larger changes pass only by an accidental 128-bit match. imm128 catches
every change confined to one byte for certain (`_imm128_sums` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch
import xxhash

XXH3_128 = "xxh3_128"
WSUM128 = "wsum128"
IMM128 = "imm128"
CHECKSUM_ALGORITHMS = (XXH3_128, WSUM128, IMM128)
ON_DEVICE = (WSUM128, IMM128)
"""Computed by torch on the bucket's own device."""

# Words summed per kernel launch (a 32 MiB bucket is one launch): bounds the temporary, the
# products, at 8 bytes a word.
_CHUNK_WORDS = 1 << 23
_MASK64 = (1 << 64) - 1
# imm128: rows of this many bytes, times an int8 matrix of this many columns. torch._int_mm
# needs more than 16 rows and both sizes a multiple of 8 (on CUDA; the CPU kernel takes any).
_ROW_BYTES = 4096
_COLUMNS = 8
_MIN_ROWS = 17


def algorithm_for(device: torch.device | str) -> str:
    """The algorithm a publisher whose packed buffer lives on `device` should use."""
    return XXH3_128 if torch.device(device).type == "cpu" else WSUM128


def bucket_checksum(view: torch.Tensor, algorithm: str = XXH3_128) -> str:
    """The hex checksum of one bucket (a flat uint8 tensor on any device).

    Safe to call from worker threads: xxh3 releases the GIL, and the torch kernels of wsum128
    run on the calling thread's stream.
    """
    if algorithm == XXH3_128:
        if view.device.type != "cpu":
            view = view.cpu()
        return xxhash.xxh3_128_hexdigest(view.numpy().data)
    if algorithm in ON_DEVICE:
        with _own_stream(view.device):
            return _digest(algorithm, _device_sums(algorithm, view))
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {CHECKSUM_ALGORITHMS}")


def start_bucket_checksum(view: torch.Tensor, algorithm: str) -> Callable[[], str]:
    """Begin checksumming one bucket; the returned call gives the digest (run it in a thread).

    A CUDA bucket under wsum128 whose coefficients are ready has its kernels queued right here,
    on the calling thread (a few asynchronous launches), and the returned call only waits for
    them: the thread pool then never holds the GIL to launch kernels while the event loop
    needs it to take in the next bucket. Anything else is computed by the returned call.
    """
    if (
        algorithm not in ON_DEVICE
        or view.device.type != "cuda"
        # Coefficients take ~0.1 s of host time to make, once per process: not on the caller.
        or not _coefficients_ready(algorithm, view)
    ):
        return functools.partial(bucket_checksum, view, algorithm)
    with _own_stream(view.device):
        sums = _device_sums(algorithm, view)
        done = torch.cuda.Event()
        done.record()
    return functools.partial(_wait_for_digest, algorithm, sums, done)


def checksum_landed(view: torch.Tensor, algorithm: str, pool: Executor) -> asyncio.Future[str]:
    """The digest of a bucket that has just been received, as a future (see the module
    docstring for where it is computed). Call it from the event loop."""
    loop = asyncio.get_running_loop()
    if algorithm == XXH3_128 and view.device.type == "cpu":
        digest: asyncio.Future[str] = loop.create_future()
        try:
            digest.set_result(bucket_checksum(view, algorithm))
        except Exception as exc:  # handed to whoever awaits it, as the pool would
            digest.set_exception(exc)
        return digest
    return loop.run_in_executor(pool, start_bucket_checksum(view, algorithm))


def _wait_for_digest(algorithm: str, sums: torch.Tensor, done: torch.cuda.Event) -> str:
    done.synchronize()
    return _digest(algorithm, sums)


def _device_sums(algorithm: str, view: torch.Tensor) -> torch.Tensor:
    """The sums of an on-device algorithm, as int64 on the bucket's device (queued)."""
    if algorithm == WSUM128:
        return _wsum128_sums(_as_words(view))
    return _imm128_sums(_as_rows(view))


def _coefficients_ready(algorithm: str, view: torch.Tensor) -> bool:
    if algorithm == WSUM128:
        return _coefficients.ready((view.numel() + 3) // 4, view.device)
    return _row_weights.ready(_row_count(view.numel()), view.device)


def _digest(algorithm: str, sums: torch.Tensor) -> str:
    if algorithm == WSUM128:
        low, high = sums.tolist()
        return f"{low & _MASK64:016x}{high & _MASK64:016x}"
    # imm128: the eight 64-bit sums, little-endian, folded to 128 bits by xxh3.
    return xxhash.xxh3_128_hexdigest(sums.cpu().numpy().astype("<i8").tobytes())


def _imm128_sums(rows: torch.Tensor) -> torch.Tensor:
    """imm128's eight sums as an int64 tensor [8] (queued, not waited for).

    One int8 matrix product reads the bucket once: row r of the bucket times the fixed matrix
    M [4096, 8] gives 8 exact int32 values (each at most 4096 * 128 * 128 = 2^26). Column j's
    values, each times its own odd 64-bit weight w[r, j], sum to S_j mod 2^64. Every entry of M
    is odd, so a change confined to one byte changes every S_j for certain (a nonzero change
    of at most 2^15 times an odd weight is nonzero mod 2^64); the row weights catch rows that
    trade places."""
    products = torch._int_mm(rows, _imm_matrix.get(_ROW_BYTES, rows.device))
    weights = _row_weights.get(rows.shape[0], rows.device)
    return (products.to(torch.int64) * weights).sum(dim=0)


def _wsum128_sums(words: torch.Tensor) -> torch.Tensor:
    """The two sums as an int64 tensor [2] on the words' device (queued, not waited for)."""
    coefficients = _coefficients.get(words.numel(), words.device)  # [2, words]
    sums = [
        # int32 products wrap mod 2^32; their int64 sum over a chunk is exact. Few kernels per
        # bucket matter: each launch holds the GIL the event loop needs.
        (words[start : start + _CHUNK_WORDS] * coefficients[:, start : start + _CHUNK_WORDS]).sum(
            dim=1, dtype=torch.int64
        )
        for start in range(0, words.numel(), _CHUNK_WORDS)
    ]
    if not sums:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    return torch.stack(sums).sum(dim=0)


def _as_words(view: torch.Tensor) -> torch.Tensor:
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


def _row_count(nbytes: int) -> int:
    return max(_MIN_ROWS, -(-nbytes // _ROW_BYTES))


def _as_rows(view: torch.Tensor) -> torch.Tensor:
    """The bucket as int8 rows of _ROW_BYTES, zero-padded to whole rows and at least _MIN_ROWS
    (a copy only then, or for a start that is not 16-byte aligned: cuBLAS wants it; the length
    is checked on its own, as for wsum128)."""
    flat = view.reshape(-1)
    rows = _row_count(flat.numel())
    if flat.numel() != rows * _ROW_BYTES or flat.data_ptr() % 16:
        padded = torch.zeros(rows * _ROW_BYTES, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel()] = flat
        flat = padded
    return flat.view(torch.int8).view(rows, _ROW_BYTES)


class _PrefixCache:
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


def _splitmix(count: int, offset: int = 0) -> np.ndarray:
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


def _make_coefficients(words: int) -> torch.Tensor:
    """wsum128's [2, words] int32: the low and high halves of each position's splitmix, odd."""
    x = _splitmix(words)
    low = (x & np.uint64(0xFFFFFFFF)).astype(np.uint32) | np.uint32(1)
    high = (x >> np.uint64(32)).astype(np.uint32) | np.uint32(1)
    return torch.from_numpy(np.stack([low, high]).view(np.int32))


def _make_row_weights(rows: int) -> torch.Tensor:
    """imm128's [rows, 8] int64 weights: each (row, column)'s splitmix, odd."""
    x = _splitmix(rows * _COLUMNS) | np.uint64(1)
    return torch.from_numpy(x.view(np.int64).reshape(rows, _COLUMNS))


def _make_imm_matrix() -> torch.Tensor:
    """imm128's [4096, 8] int8 matrix: odd values in -127..127, from splitmix (positions after
    the row weights' first 2^40, which no bucket reaches)."""
    x = _splitmix(_ROW_BYTES * _COLUMNS, offset=1 << 40)
    magnitude = ((x & np.uint64(0x3F)) * np.uint64(2) + np.uint64(1)).astype(np.int16)  # 1..127
    sign = np.where((x >> np.uint64(6)) & np.uint64(1), -1, 1).astype(np.int16)
    return torch.from_numpy((magnitude * sign).astype(np.int8).reshape(_ROW_BYTES, _COLUMNS))


_coefficients = _PrefixCache(_make_coefficients, dim=1)
_row_weights = _PrefixCache(_make_row_weights, dim=0)
_imm_matrix = _PrefixCache(lambda _: _make_imm_matrix(), dim=0)  # one size: [4096, 8]


_streams = threading.local()


def _own_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """On a GPU, a stream of this thread's own, not the legacy default stream, so the kernels
    neither wait for nor hold up the copies UCX runs on its streams (a bucket arrived whole
    before anyone checksums it: a UCX receive completes only after its copy). Nothing on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    by_device: dict[torch.device, torch.cuda.Stream] = _streams.__dict__.setdefault("by_device", {})
    if device not in by_device:
        by_device[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(by_device[device])
