"""imm128: the bucket as int8 rows of 4 KiB times a fixed int8 matrix [4096, 8]
(torch._int_mm, tensor cores on a GPU), each product weighted by its row: one pass over the
bucket, on its own device. Integer arithmetic only: the same bytes give the same digest on any
device. Opt-in (`trainer.weight_checksum`): wsum128 is the GPU default (docs/decisions/0107).

Every change confined to one byte is caught for certain (`sums` says why).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from robustrl.weights.checksums.device import DeviceAlgorithm, PrefixCache, own_stream, splitmix

NAME = "imm128"

# Rows of this many bytes, times an int8 matrix of this many columns. torch._int_mm needs more
# than 16 rows and both sizes a multiple of 8 (on CUDA; the CPU kernel takes any).
_ROW_BYTES = 4096
_COLUMNS = 8
_MIN_ROWS = 17


def checksum(view: torch.Tensor) -> str:
    """The hex digest of one bucket (a flat uint8 tensor on any device), computed there on
    this thread's stream."""
    with own_stream(view.device):
        return digest(sums(view).tolist())


def sums(view: torch.Tensor) -> torch.Tensor:
    """The eight sums as an int64 tensor [8] (queued, not waited for).

    One int8 matrix product reads the bucket once: row r of the bucket times the fixed matrix
    M [4096, 8] gives 8 exact int32 values (each at most 4096 * 128 * 128 = 2^26). Column j's
    values, each times its own odd 64-bit weight w[r, j], sum to S_j mod 2^64. Every entry of M
    is odd, so a change confined to one byte changes every S_j for certain (a nonzero change
    of at most 2^15 times an odd weight is nonzero mod 2^64); the row weights catch rows that
    trade places."""
    rows = as_rows(view)
    products = torch._int_mm(rows, _matrix.get(_ROW_BYTES, rows.device))
    weights = _row_weights.get(rows.shape[0], rows.device)
    return (products.to(torch.int64) * weights).sum(dim=0)


def run_sums(views: list[torch.Tensor]) -> torch.Tensor:
    """[buckets, 8] for a run of buckets, queued on the current stream."""
    return torch.stack([sums(view) for view in views])


def ready(view: torch.Tensor) -> bool:
    """Whether the bucket's sums can be queued at once: its row weights made on its device."""
    return _row_weights.ready(_row_count(view.numel()), view.device)


def digest(eight: list[int]) -> str:
    """The eight 64-bit sums, little-endian, folded to 128 bits by xxh3."""
    return xxhash.xxh3_128_hexdigest(np.array(eight, dtype="<i8").tobytes())


ALGORITHM = DeviceAlgorithm(sums=sums, run_sums=run_sums, ready=ready, digest=digest)


def _row_count(nbytes: int) -> int:
    return max(_MIN_ROWS, -(-nbytes // _ROW_BYTES))


def as_rows(view: torch.Tensor) -> torch.Tensor:
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


def _make_row_weights(rows: int) -> torch.Tensor:
    """[rows, 8] int64 weights: each (row, column)'s splitmix, odd."""
    x = splitmix(rows * _COLUMNS) | np.uint64(1)
    return torch.from_numpy(x.view(np.int64).reshape(rows, _COLUMNS))


def _make_matrix() -> torch.Tensor:
    """The [4096, 8] int8 matrix: odd values in -127..127, from splitmix (positions after the
    row weights' first 2^40, which no bucket reaches)."""
    x = splitmix(_ROW_BYTES * _COLUMNS, offset=1 << 40)
    magnitude = ((x & np.uint64(0x3F)) * np.uint64(2) + np.uint64(1)).astype(np.int16)  # 1..127
    sign = np.where((x >> np.uint64(6)) & np.uint64(1), -1, 1).astype(np.int16)
    return torch.from_numpy((magnitude * sign).astype(np.int8).reshape(_ROW_BYTES, _COLUMNS))


_row_weights = PrefixCache(_make_row_weights, dim=0)
_matrix = PrefixCache(lambda _: _make_matrix(), dim=0)  # one size: [4096, 8]
