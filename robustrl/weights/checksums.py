"""Bucket checksums for the weight plane: one name per algorithm, computed where the bytes are.

A manifest names the algorithm its bucket checksums were made with; every puller verifies with
that one, on whatever device its copy lives:

    xxh3_128   xxhash's xxh3, 128 bits, on the host. ~30 GB/s a core. A CUDA copy must come
               back to the host to be hashed (measured on an H100: 1.3 GB/s, against 85-300
               GB/s for the GPU-to-GPU transfer itself).
    wsum128    two position-weighted sums of the bucket's 32-bit words, on the bucket's own
               device: a CUDA bucket is verified without leaving the GPU (one Triton kernel
               there, torch's kernels elsewhere). The same bytes give the same digest on any
               device (integer arithmetic only).
    imm128     the bucket as int8 rows of 4 KiB times a fixed int8 matrix [4096, 8]
               (torch._int_mm, tensor cores on a GPU), each product weighted by its row: one
               pass over the bucket. Same bytes, same digest on any device. Opt-in
               (`trainer.weight_checksum`): 11.6 GB/s warm on this 2-core VM's CPU (xxh3:
               32); on an H200 207-493 GB/s, slower than wsum128's Triton kernel (below).

A publisher picks by where its packed buffer lives (`algorithm_for`), unless told one. A puller
checks each bucket as it lands (`LandedChecks`): a host bucket under xxh3 on the event loop's
own thread, GPU buckets in runs on the GPU, anything else in a thread pool. Within one host UCX
copies the bytes inside the progress call of the receiving worker (CMA's process_vm_readv). On
hosts without CUDA a puller's worker is progressed by a thread of its own
(ucx_progress.pull_context), so the next bucket copies while the loop hashes the last. With
ROBUSTRL_UCX_PULL_THREAD=0 (and in the experiments below but the last) the event loop progresses
the worker: the copy runs on the loop's thread but without the GIL, and xxh3 releases it too, so
a pool thread could hash one bucket while the next one copies. That bought nothing: copy and
hash both stream memory and share its bandwidth (xxh3 reads a 32 MiB bucket at 30-44 GB/s from
cache, 8-9 GB/s from DRAM, on 2 cores). Measured side by side on 2 cores, pulls with the hash
inline, on the bucket just landed, were 20-35% faster in one run and level with the pool in
another, and inline costs no thread hand-off per bucket. Hashing each bucket in 1-8 MiB frames
as they land (each frame its own message, one streaming xxh3 per bucket), in the hope of reading
them from cache, was no faster either: in one run at 64-256 MiB, 0.68-0.78 of plain ucxx inline
and 0.46-0.73 in a pool, against 0.72-0.80 for whole buckets inline. Nor was keeping fewer
frames in flight, so that each is hashed before later copies push it out of cache: 256 MiB in
2-16 MiB frames with 1, 2 or 4 in flight, inline or on one pool thread, reached 0.63-0.73 of
plain ucxx, against 0.66 inline and 0.68 pooled for whole 32 MiB buckets in the same run (median
of 7, 2 cores). Inline, even a hash from cache adds its time to the copy's; why the pool
overlaps so little was not found. With the copy on the pulling thread, frames were no better:
plain ucxx into a verified receive on that worker, 256 MiB in 2, 4 or 8 MiB frames reached 0.67,
0.75 and 0.78 of plain ucxx, whole 32 MiB buckets 0.80; whole buckets at 64 MiB 0.72 and at 1
GiB 1.03, and 16 MiB buckets the same (median of 7, 2 cores, one run). Frames for the last
bucket only, to shorten the hash after the last byte lands (~1 ms of a 64 MiB pull): 8 MiB
frames took 64 MiB pulls from 7.95 to 7.66 ms (medians of five runs side by side, noise as
large), not enough for a tag per frame in the protocol; not kept.

What bounds a verified pull with the copy on the pulling thread is memory bandwidth, not
cores. Measured on this 2-core VM (32 MiB buffers, numpy's copy and xxh3 in threads, median
of 7, 2026-11-27): one thread copies at 21.1 GB/s and two together at 19.2 in all; xxh3 hashes
at 33.5 on one thread; a copy beside a hash falls to 16.3 GB/s while the hash runs at 28.7. So
a pull that hashes bucket k while bucket k+1 copies moves at most ~16 GB/s against plain
ucxx's 21 (0.78), and at 64 MiB, two buckets, the first copy runs alone and the last hash after
it: (1.6 + 2.1 + 1.0) ms against 3.2, about 0.69, what ours reaches there. Hashing the last
bucket's halves on two threads (a tree of two xxh3 digests) took 0.98 ms against 0.98 for one
thread, right after a copy: not worth a new algorithm. Nor did a tapered tail pay (buckets
shrinking towards the end, each one's copy long enough to hide the hash of the one before, so
that only a 1-2 MiB hash follows the last byte): +verify with 5-14 buckets tapering to 1-2 MiB
reached 0.72-0.76 of plain ucxx at 64 MiB and 0.77-0.81 at 256, against 0.75 and 0.82 for
32 MiB buckets and 0.75 and 0.76 for 16 MiB (median of 7 paired, 2 cores, 2026-11-27): what a
short last hash saves, the more messages cost.

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
against 31.5 GB/s). Where a 64 MiB pull's time goes on the pulling thread, traced event by
event on 2 cores (two 32 MiB buckets, three pulls): the holder posted its first send 0.73-0.81
ms after the pull began (plain ucxx 0.48-0.61: ours has a reply before it), the first bucket
landed 2.5 ms later, its hash took 1.2-1.35 ms on the loop while the second bucket copied
(which took 2.9-3.0 ms, against 2.3-2.5 for plain ucxx's second copy, as the hash shares
memory bandwidth with it), and the second bucket's hash the same again after its last byte.
The benchmark prints the hashing as check_s: 2.45 ms of 6.29 receiving at 64 MiB, 11.3 of
22.4 at 256 (median of 7).

On a GPU, wsum128 runs as one Triton kernel (wsum_triton) that reads each word once and makes
its coefficients in registers, where torch's kernels read a coefficient table and write and read
back the products. Measured on an H200 (16 cores, one run each): the kernel checksummed 32 MiB
at 0.7-1.1 TB/s and 256 MiB at 2.1-2.4, torch's kernels 196-204 GB/s, imm128's int8 product
207-493 GB/s (cuBLAS with 8 columns), a copy of the same bytes 1.8-2.1 TB/s. Where a bucket's
kernels were queued per bucket and a pool thread waited for each, verified GPU-to-GPU pulls of
64 MiB-1 GiB reached 0.16-0.25 of plain ucxx with the kernel (0.14-0.19 with torch's): each
wait crossed threads and the GIL. LandedChecks now queues one launch per run of buckets and
polls its event from the event loop: 0.32-0.35 with runs of 256 MiB, and "+verify" (plain ucxx
checking as the transport does) rose from 0.20-0.32 to 0.41-0.70 of plain ucxx. Runs as long as
the pull (GPU_RUN_BYTES), checked after the last bucket, beat runs that overlap the copies: in
one run side by side at 64 MiB and 1 GiB, ours/plain 0.36 and 0.48 against 0.33 and 0.34 with
256 MiB runs and 0.21 and 0.18 with a launch per 32 MiB bucket; +verify/plain 0.75 and 0.78,
0.64 and 0.48, 0.46 and 0.21. What is left of ours is mostly fixed costs per pull at a GPU's
speed: a 1 GiB pull took 6.0-6.7 ms, of which 0.3-0.7 ms the manifest, 0.4-0.8 ms the request,
3.4-4.1 ms receiving and 1.0 ms verifying after the last bucket, against 2.6-3.5 ms for plain
ucxx. Parsing each manifest once (ucx_transport's UcxTransport._manifest, with its digest made
once), taking a bucket into a run in O(1) and reading a run's sums back with one tolist took
1 GiB pulls to 4.8-5.6 ms (ours/plain 0.54 in two runs side by side with the old code's 0.47,
on one H200): 0.05 ms the manifest, 0.4-0.5 the request, 3.6-4.3 receiving, 0.5-0.6 verifying.
Timed bucket by bucket there, ours received its 32 buckets in the time plain ucxx took (2.1
against 2.2 ms from the first to the last); the rest is the request's round trip (the holder's
reply came 0.46 ms after the pull began; posting the first receives before it made the reply
arrive later, 0.73 ms, and the pull slower), queuing the run's kernel after the last bucket
and the kernel itself (0.43 ms a GiB, 2.5 TB/s; near the GPU's integer throughput, as
splitmix64 takes three 64-bit products a word). Queuing took 0.09-0.2 ms timed alone but 0.26
ms inside 64 MiB pulls, ours and "+verify" alike; why was not found. At 64 MiB, where plain ucxx
takes 0.6 ms, these fixed costs hold ours near 0.3-0.4 of it. imm128 is no faster than
wsum128's kernel anywhere measured; it stays opt-in.

Measured again on an H200 (2026-11-27; five runs of the benchmark, each the median of 5, 32 MiB
buckets), with the wait for the first bucket timed apart (PullTimings.first_s): ours/plain
0.34-0.40 at 64 MiB, 0.41-0.52 at 256 MiB, 0.45-0.59 at 1 GiB (paired). Plain ucxx itself
waits 0.64-1.06 ms for its first bucket whatever the size (the copy of 32 MiB takes some 20 us
there), then takes 63-88 us a bucket with 4 posted ahead and ~45 with 8 or 16: a turn of the
event loop per message, not the copy engine, paces it, and ours streams at the same pace
(69-93 us a bucket). On top of that, ours pays per pull: the request, 0.34-0.49 ms; queuing
the run's checksum, 0.30-0.45 ms of host time, the same inside pulls and timed alone (Triton's
launch with the reduction of its partials 0.19-0.26, entering our stream 0.05-0.07, the pinned
copy back 0.06-0.08, recording the event 0.04-0.05); and, after the last bucket, the kernel,
0.3-0.45 ms at 1 GiB. Reading the sums back with one tolist of the GPU tensor instead of the
pinned copy saved the copy's queuing but took 0.1 ms itself, and the pulls were no faster: not
kept. Posting 8 or 16 buckets ahead, or cutting 128 MiB buckets, sped plain ucxx more than
ours, so the ratios did not rise. So at 64 MiB, where plain ucxx takes 0.74-0.78 ms, 0.8 of it
would leave ours 0.19 ms for its request and its verification together, out of reach of a
requested, verified pull; at 1 GiB these fixed costs (1.0-1.4 ms) would have to fall below
~0.6. Untried: one CUDA graph per receive buffer and run for the checksum's kernels, copy back
and event (a replay instead of ~0.35 ms of launches), and the holder's answer to a request sent
with its first bucket instead of before it.

No algorithm here is a defence against an adversary (see ucx_transport); all catch flipped
bits, torn, misplaced and reordered transfers. wsum128 catches every change confined to one
32-bit word for certain (each coefficient is odd, so a nonzero word difference times it is
nonzero mod 2^32); larger changes pass only by an accidental 128-bit match. imm128 catches
every change confined to one byte for certain (`_imm128_sums` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch
import xxhash

from robustrl.core.logs import get_logger

log = get_logger(__name__)

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
            return _digest(algorithm, _device_sums(algorithm, view).tolist())
    raise _unknown(algorithm)


def _unknown(algorithm: str) -> ValueError:
    return ValueError(f"unknown checksum algorithm {algorithm!r}; known: {CHECKSUM_ALGORITHMS}")


class LandedChecks:
    """The checksums of buckets as they land, in the order they land; call it from the event
    loop. `landed` takes each bucket just received, `results` gives (key, digest) for every
    one, in that order (the first failure to compute one is raised there).

    Where each is computed (see the module docstring for why): a host bucket under xxh3 at
    once, on the loop's own thread; a bucket in GPU memory under an on-device algorithm, by
    kernels queued from the loop's thread on a stream of ours, in runs: consecutive buckets of
    one size that lie back to back in memory (up to GPU_RUN_BYTES) are checked by one launch
    of wsum_triton's kernel, their sums copied back in one transfer, and the loop learns they
    are done by polling a CUDA event: no thread hand-off and no launch per bucket. Anything
    else (and a GPU's first run, which compiles the kernel or makes coefficients) in the thread
    pool.
    """

    def __init__(self, algorithm: str, pool: Executor) -> None:
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise _unknown(algorithm)
        self.algorithm = algorithm
        self._pool = pool
        self._run: list[tuple[int, torch.Tensor]] = []
        # The run's storage, the address just past its last bucket, its buckets' size, its
        # last bucket's and its bytes: a bucket joins it in O(1), with one look at its tensor
        # (a GPU pull's loop takes 32 buckets a GiB between receives).
        self._storage = self._next = self._size = self._last = self._bytes = 0
        self._started: list[tuple[list[int], asyncio.Future[list[str]]]] = []

    def landed(self, key: int, view: torch.Tensor) -> None:
        """Take one bucket that has arrived whole (a flat uint8 tensor)."""
        nbytes, address = view.numel(), view.data_ptr()
        # Whole words only: a ragged bucket (a version's last) is checked on its own.
        in_runs = (
            self.algorithm in ON_DEVICE and view.is_cuda and nbytes % 4 == 0 and address % 16 == 0
        )
        storage = view.untyped_storage().data_ptr() if in_runs else 0
        if self._run and not (
            in_runs
            and storage == self._storage
            and address == self._next
            and nbytes <= self._size == self._last
        ):
            self._start_run()
        if not self._run:
            self._storage, self._size = storage, nbytes
        self._run.append((key, view))
        self._next, self._last = address + nbytes, nbytes
        self._bytes += nbytes
        if not in_runs or self._bytes >= GPU_RUN_BYTES:
            self._start_run()

    async def results(self) -> list[tuple[int, str]]:
        """Every bucket's digest, once all are computed."""
        if self._run:
            self._start_run()
        out: list[tuple[int, str]] = []
        for keys, digests in self._started:
            out.extend(zip(keys, await digests, strict=True))
        return out

    def _start_run(self) -> None:
        keys = [key for key, _ in self._run]
        views = [view for _, view in self._run]
        self._run = []
        self._bytes = 0
        self._started.append((keys, _run_digests(views, self.algorithm, self._pool)))


# Bytes of consecutive GPU buckets checked by one launch. Checked while later buckets copy,
# runs slowed the copies more than they saved (module docstring): a pull of up to 1 GiB is
# checked after its last bucket (~0.5 ms a GiB on an H200), a longer one a GiB at a time.
GPU_RUN_BYTES = 1 << 30
# Polls of a run's event on every turn of the loop before it waits a little between polls.
_EAGER_POLLS = 1000
_POLL_S = 0.0002


def _run_digests(
    views: list[torch.Tensor], algorithm: str, pool: Executor
) -> asyncio.Future[list[str]]:
    loop = asyncio.get_running_loop()
    first = views[0]
    if algorithm == XXH3_128 and first.device.type == "cpu":
        digests: asyncio.Future[list[str]] = loop.create_future()
        try:
            digests.set_result(_digests_of(views, algorithm))
        except Exception as exc:  # handed to whoever awaits it, as the pool would
            digests.set_exception(exc)
        return digests
    if algorithm in ON_DEVICE and first.device.type == "cuda" and _sums_ready(algorithm, first):
        with _own_stream(first.device):
            sums = _run_sums(algorithm, views)
            on_host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            on_host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return asyncio.ensure_future(_digests_when_done(algorithm, on_host, done))
    return loop.run_in_executor(pool, _digests_of, views, algorithm)


def _digests_of(views: list[torch.Tensor], algorithm: str) -> list[str]:
    return [bucket_checksum(view, algorithm) for view in views]


async def _digests_when_done(
    algorithm: str, on_host: torch.Tensor, done: torch.cuda.Event
) -> list[str]:
    polls = 0
    while not done.query():
        polls += 1
        await asyncio.sleep(0 if polls < _EAGER_POLLS else _POLL_S)
    # One tolist for the run: a row's each took ~2 us, 0.07 ms for a GiB's 32 on an H200.
    return [_digest(algorithm, sums) for sums in on_host.tolist()]


def _run_sums(algorithm: str, views: list[torch.Tensor]) -> torch.Tensor:
    """[buckets, sums] for a run of back-to-back buckets, queued on the current stream."""
    first = views[0]
    kernel = _wsum128_kernels.get(first.device) if algorithm == WSUM128 else None
    if kernel is None or len(views) == 1:
        return torch.stack([_device_sums(algorithm, view) for view in views])
    span = sum(view.numel() for view in views)
    words = first.as_strided((span,), (1,)).view(torch.int32)
    return kernel(words, first.numel() // 4)


def _device_sums(algorithm: str, view: torch.Tensor) -> torch.Tensor:
    """The sums of an on-device algorithm, as int64 on the bucket's device (queued)."""
    if algorithm == WSUM128:
        return _wsum128_sums(_as_words(view))
    return _imm128_sums(_as_rows(view))


def _sums_ready(algorithm: str, view: torch.Tensor) -> bool:
    """Whether the bucket's sums can be queued at once: the kernel checked, or the tables made
    (making either takes 0.1-1 s of host time, once per process and device)."""
    if algorithm == WSUM128:
        return _wsum128_kernels.get(view.device) is not None or _coefficients.ready(
            (view.numel() + 3) // 4, view.device
        )
    return _row_weights.ready(_row_count(view.numel()), view.device)


def _digest(algorithm: str, sums: list[int]) -> str:
    if algorithm == WSUM128:
        low, high = sums
        return f"{low & _MASK64:016x}{high & _MASK64:016x}"
    # imm128: the eight 64-bit sums, little-endian, folded to 128 bits by xxh3.
    return xxhash.xxh3_128_hexdigest(np.array(sums, dtype="<i8").tobytes())


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
    if words.device.type == "cuda":
        kernel = _wsum128_kernel(words.device)
        if kernel is not None:
            return kernel(words, words.numel())[0]
    return _wsum128_torch_sums(words)


def _wsum128_torch_sums(words: torch.Tensor) -> torch.Tensor:
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


# wsum_triton.wsum128_sums: (words, words per bucket) -> [buckets, 2].
_Kernel = Callable[[torch.Tensor, int], torch.Tensor]
# Per CUDA device: wsum_triton's kernel once it has given torch's sums on a probe there, or
# None where it may not be used (no triton, turned off, or it failed the probe).
_wsum128_kernels: dict[torch.device, _Kernel | None] = {}
_wsum128_kernels_lock = threading.Lock()
# Probe: several buckets of many programs each, the last bucket and each bucket's last
# program ragged.
_PROBE_WORDS = (1 << 20) + 5
_PROBE_BUCKET_WORDS = (1 << 18) + 3


def _wsum128_kernel(device: torch.device) -> _Kernel | None:
    """wsum_triton's kernel for `device`, checked on first use there (compiling it takes a
    second or so), or None to use torch's kernels. ROBUSTRL_WSUM_KERNEL=torch turns it off."""
    if device in _wsum128_kernels:
        return _wsum128_kernels[device]
    with _wsum128_kernels_lock:
        if device not in _wsum128_kernels:
            _wsum128_kernels[device] = _checked_wsum128_kernel(device)
        return _wsum128_kernels[device]


def _checked_wsum128_kernel(device: torch.device) -> _Kernel | None:
    if os.environ.get("ROBUSTRL_WSUM_KERNEL", "triton") == "torch":
        return None
    try:
        from robustrl.weights import wsum_triton
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
        _wsum128_torch_sums(probe[start : start + _PROBE_BUCKET_WORDS]).tolist()
        for start in range(0, _PROBE_WORDS, _PROBE_BUCKET_WORDS)
    ]
    if got != wanted:
        log.error("checksums.wsum128_kernel_mismatch", device=str(device), got=got, wanted=wanted)
        return None
    log.info("checksums.wsum128_kernel_ready", device=str(device))
    kernel: _Kernel = wsum_triton.wsum128_sums
    return kernel


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
