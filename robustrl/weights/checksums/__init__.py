"""Bucket checksums for the weight plane: a small registry of algorithms by name, each computed
where the bytes are.

A manifest names the algorithm its bucket checksums were made with (protocol.py); every puller
verifies with that one, on whatever device its copy lives:

    xxh3_128   xxhash's xxh3, 128 bits, on the host (xxh3.py). A CUDA copy comes back to the
               host to be hashed.
    wsum128    two position-weighted sums of the bucket's 32-bit words, on the bucket's own
               device (wsum128.py): a CUDA bucket is verified without leaving the GPU, by one
               Triton kernel there (wsum_triton.py), torch's kernels elsewhere.
    imm128     the bucket as int8 rows times a fixed int8 matrix, each product weighted by its
               row, on the bucket's own device (imm128.py). Opt-in (`trainer.weight_checksum`).

wsum128 and imm128 use integer arithmetic only: the same bytes give the same digest on any
device. Every algorithm catches flipped bits and torn, misplaced and reordered transfers; none
is a defence against an adversary (protocol.py says why none needs to be).

A publisher picks by where its packed buffer lives (`algorithm_for`: xxh3 on the host, wsum128
on a GPU), unless told one. A puller checks each bucket as it lands (`LandedChecks`): a host
bucket under xxh3 at once, on the event loop's own thread (on hosts without CUDA a thread of
the puller's own progresses its UCX worker, so the next bucket copies meanwhile:
ucx/progress.pull_context); GPU buckets in runs, one kernel launch per run, on the GPU; anything
else in a thread pool. Why these choices, with their measurements: docs/decisions/0101-0107.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from robustrl.weights.checksums import imm128, wsum128, xxh3
from robustrl.weights.checksums.device import DeviceAlgorithm, own_stream

XXH3_128 = xxh3.NAME
WSUM128 = wsum128.NAME
IMM128 = imm128.NAME

ALGORITHMS: dict[str, Callable[[torch.Tensor], str]] = {
    XXH3_128: xxh3.checksum,
    WSUM128: wsum128.checksum,
    IMM128: imm128.checksum,
}
"""Every algorithm by name: the hex checksum of one bucket (a flat uint8 tensor, any device)."""
ON_DEVICE_ALGORITHMS: dict[str, DeviceAlgorithm] = {
    WSUM128: wsum128.ALGORITHM,
    IMM128: imm128.ALGORITHM,
}
"""The algorithms torch computes on the bucket's own device, which LandedChecks runs there."""
CHECKSUM_ALGORITHMS = tuple(ALGORITHMS)
ON_DEVICE = tuple(ON_DEVICE_ALGORITHMS)

GPU_RUN_BYTES = 1 << 30
"""Bytes of consecutive GPU buckets checked by one launch: a pull of up to 1 GiB is checked
after its last bucket, a longer one a GiB at a time (docs/decisions/0105)."""
# Polls of a run's event on every turn of the loop before it waits a little between polls.
_EAGER_POLLS = 1000
_POLL_S = 0.0002


def algorithm_for(device: torch.device | str) -> str:
    """The algorithm a publisher whose packed buffer lives on `device` should use."""
    return XXH3_128 if torch.device(device).type == "cpu" else WSUM128


def bucket_checksum(view: torch.Tensor, algorithm: str = XXH3_128) -> str:
    """The hex checksum of one bucket (a flat uint8 tensor on any device).

    Safe to call from worker threads: xxh3 releases the GIL, and the torch kernels of the
    on-device algorithms run on the calling thread's stream.
    """
    checksum = ALGORITHMS.get(algorithm)
    if checksum is None:
        raise _unknown(algorithm)
    return checksum(view)


def _unknown(algorithm: str) -> ValueError:
    return ValueError(f"unknown checksum algorithm {algorithm!r}; known: {CHECKSUM_ALGORITHMS}")


class LandedChecks:
    """The checksums of buckets as they land, in the order they land; call it from the event
    loop. `landed` takes each bucket just received, `results` gives (key, digest) for every
    one, in that order (the first failure to compute one is raised there).

    Where each is computed: a host bucket under xxh3 at once, on the loop's own thread; a
    bucket in GPU memory under an on-device algorithm, by kernels queued from the loop's thread
    on a stream of ours, in runs: consecutive buckets of one size that lie back to back in
    memory (up to GPU_RUN_BYTES) are checked by one launch of wsum_triton's kernel, their sums
    copied back in one transfer, and the loop learns they are done by polling a CUDA event: no
    thread hand-off and no launch per bucket. Anything else (and a GPU's first run, which
    compiles the kernel or makes coefficients) in the thread pool.
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
    on_device = ON_DEVICE_ALGORITHMS.get(algorithm)
    if on_device is not None and first.device.type == "cuda" and on_device.ready(first):
        with own_stream(first.device):
            sums = on_device.run_sums(views)
            on_host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            on_host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return asyncio.ensure_future(_digests_when_done(on_device, on_host, done))
    return loop.run_in_executor(pool, _digests_of, views, algorithm)


def _digests_of(views: list[torch.Tensor], algorithm: str) -> list[str]:
    return [bucket_checksum(view, algorithm) for view in views]


async def _digests_when_done(
    on_device: DeviceAlgorithm, on_host: torch.Tensor, done: torch.cuda.Event
) -> list[str]:
    polls = 0
    while not done.query():
        polls += 1
        await asyncio.sleep(0 if polls < _EAGER_POLLS else _POLL_S)
    # One tolist for the run, not one a row.
    return [on_device.digest(sums) for sums in on_host.tolist()]
