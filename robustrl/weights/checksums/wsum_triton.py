"""wsum128's two sums in one Triton kernel, for buckets in GPU memory.

torch's kernels for wsum128 (wsum128._torch_sums) read the words and a coefficient table
twice their size, then write and read back the products: about 16 bytes of memory traffic per
byte checksummed. This kernel reads each word once and makes its coefficients in registers,
the same splitmix64 of the word's position that wsum128._make_coefficients makes on the host,
so the digest is the same bit for bit (integer sums do not depend on their order).

Imported only where triton is (GPU hosts: it comes with CUDA builds of torch); wsum128 uses it
on a device only after it has given torch's sums on a probe there (wsum128.kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words per program: BLOCK at a time, ITERS times. 8192 words (32 KiB) per program keeps a
# 32 MiB bucket at 1024 programs, several waves over the GPU's multiprocessors.
BLOCK = 1024
ITERS = 8


@triton.jit
def _wsum128_partials(  # type: ignore[no-untyped-def]  # triton reads the annotations
    words_ptr, out_ptr, n_words, bucket_words, BLOCK: tl.constexpr, ITERS: tl.constexpr
):
    # Program (chunk, bucket) sums BLOCK * ITERS words of one bucket; positions (and so the
    # coefficients) count from the bucket's first word.
    chunk = tl.program_id(0)
    bucket = tl.program_id(1)
    bucket_start = bucket.to(tl.int64) * bucket_words
    bucket_size = tl.minimum(bucket_words, n_words - bucket_start)
    low_sum = tl.zeros([BLOCK], dtype=tl.int64)
    high_sum = tl.zeros([BLOCK], dtype=tl.int64)
    start = chunk.to(tl.int64) * (BLOCK * ITERS)
    for step in range(ITERS):
        position = start + step * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = position < bucket_size
        word = tl.load(words_ptr + bucket_start + position, mask=inside, other=0)
        # splitmix64's finaliser of position + 1, wrapping mod 2^64 as on the host.
        x = (position + 1).to(tl.uint64)
        x = x * 0x9E3779B97F4A7C15
        x = x ^ (x >> 30)
        x = x * 0xBF58476D1CE4E5B9
        x = x ^ (x >> 27)
        x = x * 0x94D049BB133111EB
        x = x ^ (x >> 31)
        low = ((x & 0xFFFFFFFF) | 1).to(tl.uint32).to(tl.int32, bitcast=True)
        high = ((x >> 32) | 1).to(tl.uint32).to(tl.int32, bitcast=True)
        # int32 products wrap mod 2^32, as torch's do; their int64 sum is exact.
        low_sum += (word * low).to(tl.int64)
        high_sum += (word * high).to(tl.int64)
    out = (bucket.to(tl.int64) * tl.num_programs(0) + chunk) * 2
    tl.store(out_ptr + out, tl.sum(low_sum, axis=0))
    tl.store(out_ptr + out + 1, tl.sum(high_sum, axis=0))


def wsum128_sums(words: torch.Tensor, bucket_words: int) -> torch.Tensor:
    """The two sums of each bucket of a flat int32 tensor on a GPU, cut into buckets of
    bucket_words words (the last may be shorter), as int64 [buckets, 2], queued on the current
    stream (not waited for). One launch for all of them."""
    buckets = max(1, triton.cdiv(words.numel(), bucket_words))
    chunks = max(1, triton.cdiv(bucket_words, BLOCK * ITERS))
    partials = torch.empty(buckets, chunks, 2, dtype=torch.int64, device=words.device)
    _wsum128_partials[(chunks, buckets)](
        words, partials, words.numel(), bucket_words, BLOCK=BLOCK, ITERS=ITERS
    )
    return partials.sum(dim=1)
