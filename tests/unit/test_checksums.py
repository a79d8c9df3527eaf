"""Bucket checksums: equal bytes give equal digests anywhere, changed bytes never pass."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.common.checksums import (
    CHECKSUM_ALGORITHMS,
    IMM128,
    ON_DEVICE,
    WSUM128,
    XXH3_128,
    _as_rows,
    algorithm_for,
    bucket_checksum,
    checksum_landed,
    start_bucket_checksum,
)


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
    rows = _as_rows(data)
    assert rows.data_ptr() == data.data_ptr() and rows.shape == (32, 4096)
    short = _as_rows(data[: 3 << 12])  # too few rows for the kernel: padded with zero rows
    assert short.shape == (17, 4096) and not short[3:].any()
    assert bucket_checksum(data[:100], IMM128) != bucket_checksum(data[:101], IMM128)


def test_wsum128_spans_chunks_as_one_sum() -> None:
    # Longer than one kernel launch's chunk (4 Mi words): the tail chunk counts too.
    data = _bytes((4 << 22) + 64, seed=4)
    digest = bucket_checksum(data, WSUM128)
    data[-1] ^= 1

    assert bucket_checksum(data, WSUM128) != digest


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_a_started_checksum_gives_the_same_digest(algorithm: str) -> None:
    data = _bytes((1 << 16) + 5, seed=6)

    assert start_bucket_checksum(data, algorithm)() == bucket_checksum(data, algorithm)


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
async def test_a_landed_bucket_gets_the_same_digest_and_host_xxh3_at_once(algorithm: str) -> None:
    data = _bytes((1 << 16) + 5, seed=7)
    with ThreadPoolExecutor(max_workers=1) as pool:
        landed = checksum_landed(data, algorithm, pool)
        # A host bucket under xxh3 is hashed on the calling thread, before anything awaits.
        assert landed.done() == (algorithm == XXH3_128)
        assert await landed == bucket_checksum(data, algorithm)
        with pytest.raises(ValueError, match="unknown checksum algorithm 'crc32'"):
            await checksum_landed(data, "crc32", pool)


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
    # Queued from this thread, waited for in another, as the transport does.
    finishes = [start_bucket_checksum(on_gpu[:length], algorithm) for _ in range(3)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(pool.map(lambda finish: finish(), finishes)) == [expected] * 3
