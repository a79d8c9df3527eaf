"""Bucket checksums: equal bytes give equal digests anywhere, changed bytes never pass."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from robustrl.weights import checksums
from robustrl.weights.checksums import (
    CHECKSUM_ALGORITHMS,
    IMM128,
    ON_DEVICE,
    WSUM128,
    XXH3_128,
    LandedChecks,
    algorithm_for,
    bucket_checksum,
    wsum128,
)
from robustrl.weights.checksums.imm128 import as_rows


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_equal_bytes_give_equal_digests_wherever_they_sit(algorithm: str) -> None:
    data = _bytes(1 << 16)
    # The same bytes at an unaligned offset of another buffer, and as a fresh copy.
    shifted = torch.cat([_bytes(3, seed=1), data])[3:]

    digest = bucket_checksum(data, algorithm)

    assert bucket_checksum(shifted, algorithm) == digest
    assert bucket_checksum(data.clone(), algorithm) == digest
    assert bucket_checksum(_bytes(1 << 16, seed=2), algorithm) != digest


@pytest.mark.parametrize("algorithm", ON_DEVICE)
@pytest.mark.parametrize("length", [1 << 12, (1 << 12) + 1, (1 << 12) + 3, 5, (20 << 12) + 7])
def test_the_device_checksums_catch_every_single_byte_change(algorithm: str, length: int) -> None:
    data = _bytes(length, seed=length)
    digest = bucket_checksum(data, algorithm)
    rng = random.Random(length)
    positions = {0, length - 1, *(rng.randrange(length) for _ in range(100))}

    for position in positions:
        for flip in (0x01, 0x80, 0xFF):
            changed = data.clone()
            changed[position] ^= flip
            assert bucket_checksum(changed, algorithm) != digest, (position, flip)


@pytest.mark.parametrize("algorithm", ON_DEVICE)
@pytest.mark.parametrize(("size", "first", "second"), [(4, 0, 400), (4096, 0, 8192), (1, 5, 6)])
def test_the_device_checksums_catch_pieces_that_trade_places(
    algorithm: str, size: int, first: int, second: int
) -> None:
    """Words (wsum128's unit), whole 4 KiB rows (imm128's) and neighbouring bytes."""
    data = _bytes(20 << 12, seed=3)
    swapped = data.clone()
    swapped[first : first + size] = data[second : second + size]
    swapped[second : second + size] = data[first : first + size]
    assert not torch.equal(swapped, data)

    assert bucket_checksum(swapped, algorithm) != bucket_checksum(data, algorithm)


def test_imm128_reads_the_bucket_in_place_when_it_is_whole_rows() -> None:
    data = _bytes(32 << 12, seed=8)
    rows = as_rows(data)
    assert rows.data_ptr() == data.data_ptr() and rows.shape == (32, 4096)
    short = as_rows(data[: 3 << 12])  # too few rows for the kernel: padded with zero rows
    assert short.shape == (17, 4096) and not short[3:].any()
    assert bucket_checksum(data[:100], IMM128) != bucket_checksum(data[:101], IMM128)


def test_wsum128_spans_chunks_as_one_sum() -> None:
    # Longer than one kernel launch's chunk (4 Mi words): the tail chunk counts too.
    data = _bytes((4 << 22) + 64, seed=4)
    digest = bucket_checksum(data, WSUM128)
    data[-1] ^= 1

    assert bucket_checksum(data, WSUM128) != digest


def _buckets(buffer: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [buffer[start : start + size] for start in range(0, buffer.numel(), size)]


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
async def test_landed_buckets_get_their_own_digests_in_landing_order(algorithm: str) -> None:
    buckets = _buckets(_bytes(5 * 4096 + 5, seed=7), 4096)  # the last one ragged
    order = [1, 0, 2, 3, 5, 4]
    expected = [(i, bucket_checksum(buckets[i], algorithm)) for i in order]

    with ThreadPoolExecutor(max_workers=1) as pool:
        checks = LandedChecks(algorithm, pool)
        for i in order:
            checks.landed(i, buckets[i])
        if algorithm == XXH3_128:
            # A host bucket under xxh3 is hashed as it lands, on the calling thread.
            for bucket in buckets:
                bucket.zero_()

        assert await checks.results() == expected


def test_landed_checks_refuse_an_unknown_algorithm() -> None:
    with (
        ThreadPoolExecutor(max_workers=1) as pool,
        pytest.raises(ValueError, match="unknown checksum algorithm 'crc32'"),
    ):
        LandedChecks("crc32", pool)


def test_the_publisher_picks_by_where_its_buffer_lives_and_unknown_names_are_refused() -> None:
    assert algorithm_for("cpu") == XXH3_128
    assert algorithm_for(torch.device("cuda", 0)) == WSUM128
    with pytest.raises(ValueError, match="unknown checksum algorithm 'crc32'"):
        bucket_checksum(_bytes(8), "crc32")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
@pytest.mark.parametrize("length", [32 << 20, (1 << 20) + 3])
def test_a_gpu_copy_has_the_digest_of_the_host_copy(algorithm: str, length: int) -> None:
    data = _bytes(length, seed=5)
    expected = bucket_checksum(data, algorithm)
    on_gpu = data.cuda()

    assert bucket_checksum(on_gpu, algorithm) == expected
    if algorithm == WSUM128:
        # Computed by wsum_triton's one kernel, not torch's (slower) ones.
        assert wsum128.kernel(on_gpu.device) is not None


@pytest.mark.gpu
def test_a_wsum128_kernel_that_disagrees_on_the_probe_is_never_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from robustrl.weights.checksums import wsum_triton

    real = wsum_triton.wsum128_sums
    monkeypatch.setattr(wsum_triton, "wsum128_sums", lambda words, size: real(words, size) + 1)
    monkeypatch.setattr(wsum128, "_kernels", {})
    data = _bytes((1 << 20) + 3, seed=7)

    assert bucket_checksum(data.cuda(), WSUM128) == bucket_checksum(data, WSUM128)
    assert wsum128.kernel(torch.device("cuda", 0)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ON_DEVICE)
async def test_gpu_buckets_are_checked_in_runs_on_the_gpu_with_no_thread(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs of at most 3 buckets; bucket 4 lands out of order, so 3 and 5 start new runs; the
    # ragged last bucket is checked on its own.
    monkeypatch.setattr(checksums, "GPU_RUN_BYTES", 3 << 20)
    on_host = _bytes(9 * (1 << 20) + 3, seed=8)
    buckets = _buckets(on_host.cuda(), 1 << 20)
    order = [0, 1, 2, 3, 5, 4, 6, 7, 8, 9]
    expected = [bucket_checksum(b, algorithm) for b in _buckets(on_host, 1 << 20)]
    bucket_checksum(buckets[0], algorithm)  # the kernel checked, the tables made
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()  # nothing may go to a thread

    checks = LandedChecks(algorithm, pool)
    for i in order:
        checks.landed(i, buckets[i])

    assert await checks.results() == [(i, expected[i]) for i in order]
