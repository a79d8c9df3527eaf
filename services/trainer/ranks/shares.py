"""Publishing an FSDP2 group's weights without a whole copy anywhere: every rank packs its own
range of each version's buckets (protocol.bucket_share) straight from the shards, and the
group shares the checksums, so that rank 0 can write the version's manifest and each rank
serve its range over UCX (UcxTransport.publish_share / hold_share).

Every rank plans the same layout from the tensors' shapes (protocol.plan_layout). A tensor is
cut into pieces, one per bucket it spans; for each piece the rank that holds that bucket takes
the rows it covers from the ranks whose shards hold them (point-to-point, FSDP2 shards each
tensor's rows in order, `torch.chunk` over the ranks), copies the piece's bytes into its
buffer and checks them finite. So a rank holds its share of the version and, in flight, the
rows of one piece: about one bucket. Every function here is a collective: every rank calls
it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from robustrl.generation.serving import TensorSpec, serving_state
from robustrl.weights.checksums import bucket_checksum
from robustrl.weights.protocol import TensorEntry, bucket_share, plan_layout
from robustrl.weights.ucx.publisher import VersionShare

if TYPE_CHECKING:
    from services.trainer.ranks.group import RankGroup

TakeBuffer = Callable[[int, torch.device], torch.Tensor]
"""Where a share is packed: a flat uint8 buffer of so many bytes on that device."""


@dataclass(frozen=True)
class ShareSettings:
    """How a group packs its versions: the job's bucket size, the checksum every rank uses
    (the same on every rank: it names the manifest's), where a share's buffer comes from."""

    bucket_bytes: int
    algorithm: str
    take_buffer: TakeBuffer
    form: dict[str, TensorSpec]
    """The serving form the version is packed in (generation/serving.py)."""


@dataclass(frozen=True)
class PackedShare:
    """This rank's share of a version, and what any rank found non-finite in its pieces."""

    share: VersionShare
    nonfinite: list[str]


def pack_group_share(
    group: RankGroup, model: torch.nn.Module, settings: ShareSettings
) -> PackedShare:
    """`pack_share` of this rank of `group`, watched as one collective."""
    with group.collective("pack_share"):
        return pack_share(
            model,
            rank=group.rank,
            world_size=group.world_size,
            bucket_bytes=settings.bucket_bytes,
            algorithm=settings.algorithm,
            take_buffer=settings.take_buffer,
            form=settings.form,
        )


def pack_share(
    model: torch.nn.Module,
    *,
    rank: int,
    world_size: int,
    bucket_bytes: int,
    algorithm: str,
    take_buffer: TakeBuffer,
    form: dict[str, TensorSpec] | None = None,
) -> PackedShare:
    """This rank's share of `model`'s weights as a version (see the module docstring). Joins
    one collective per piece that crosses ranks and one that shares the checksums. In its
    serving `form` where given, else as the model holds it."""
    state = list(model.state_dict().items()) if form is None else serving_state(model, form)
    meta = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in state]
    entries, total, spans = plan_layout(meta, bucket_bytes)
    owned = [bucket_share(len(spans), r, world_size) for r in range(world_size)]
    first, stop = owned[rank]
    base = first * bucket_bytes
    size = min(stop * bucket_bytes, total) - base if stop > first else 0
    device = _device_of(state)
    buffer = take_buffer(size, device)
    for lo, hi in _gaps(entries, total):  # the checksums cover them
        lo, hi = max(lo, base), min(hi, base + size)
        if lo < hi:
            buffer[lo - base : hi - base].zero_()
    bad: set[str] = set()
    owner_of = [r for r, (a, b) in enumerate(owned) for _ in range(a, b)]
    for (name, tensor), entry in zip(state, entries, strict=True):
        rows = _Rows(tensor, rank, world_size)
        for lo, hi in _pieces(entry, bucket_bytes):
            owner = owner_of[lo // bucket_bytes]
            piece = rows.gather(lo - entry.offset, hi - entry.offset, owner)
            if piece is None:
                continue
            data, values = piece
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                bad.add(name)
            buffer[lo - base : hi - base].copy_(data)
    checksums = [
        bucket_checksum(buffer[o - base : o - base + n], algorithm) for o, n in spans[first:stop]
    ]
    shared: list[object] = [None] * world_size
    dist.all_gather_object(shared, (checksums, sorted(bad)))
    every: list[str] = []
    nonfinite: set[str] = set()
    for part in shared:
        assert isinstance(part, tuple)
        every.extend(part[0])
        nonfinite.update(part[1])
    share = VersionShare(entries, total, bucket_bytes, algorithm, tuple(every), first, stop, buffer)
    return PackedShare(share, sorted(nonfinite))


def _device_of(state: list[tuple[str, torch.Tensor]]) -> torch.device:
    for _, tensor in state:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.device
    return torch.device("cpu")


def _gaps(entries: tuple[TensorEntry, ...], total: int) -> list[tuple[int, int]]:
    """The bytes of the packed buffer no tensor covers (alignment), [lo, hi) each."""
    gaps, end = [], 0
    for entry in entries:
        if entry.offset > end:
            gaps.append((end, entry.offset))
        end = max(end, entry.offset + entry.nbytes)
    if total > end:
        gaps.append((end, total))
    return gaps


def _pieces(entry: TensorEntry, bucket_bytes: int) -> list[tuple[int, int]]:
    """A tensor's bytes in the packed buffer, cut where buckets end: [lo, hi) each."""
    out: list[tuple[int, int]] = []
    lo, end = entry.offset, entry.offset + entry.nbytes
    while lo < end:
        hi = min(end, (lo // bucket_bytes + 1) * bucket_bytes)
        out.append((lo, hi))
        lo = hi
    return out


class _Rows:
    """One tensor of the model as the ranks hold it: FSDP2's row shards (`Shard(0)`), or whole
    on every rank (a buffer, or a DTensor of another placement, gathered once)."""

    def __init__(self, tensor: torch.Tensor, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sharded = (
            isinstance(tensor, DTensor)
            and tensor.dim() > 0
            and tuple(tensor.placements) == (Shard(0),)
            and world_size > 1
        )
        if isinstance(tensor, DTensor) and not self.sharded:
            tensor = tensor.full_tensor()  # a collective: every rank takes this branch alike
        self.local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        count = self.shape[0] if self.shape else 1
        self.row_bytes = tensor.element_size() * _numel(self.shape[1:])
        self.count = count
        self.chunk = -(-count // world_size)  # rows a rank holds, the last ones fewer or none
        if self.sharded:
            held = self._held(rank)
            if self.local.shape[0] != held[1] - held[0]:
                raise RuntimeError(
                    f"rank {rank} holds {self.local.shape[0]} rows of a tensor of {count}, "
                    f"not the {held[1] - held[0]} FSDP2's even split gives"
                )

    def _held(self, rank: int) -> tuple[int, int]:
        return min(rank * self.chunk, self.count), min((rank + 1) * self.chunk, self.count)

    def gather(self, lo: int, hi: int, owner: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bytes [lo, hi) of the tensor on `owner` (as uint8, and the rows they lie in, for
        the finite check); None on the other ranks, which send what they hold of it."""
        if not self.sharded:
            if self.rank != owner:
                return None
            flat = self.local.detach().contiguous().reshape(-1)
            size = flat.element_size()
            return flat.view(torch.uint8)[lo:hi], flat[lo // size : -(-hi // size)]
        r0, r1 = lo // self.row_bytes, -(-hi // self.row_bytes)
        rows = None
        if self.rank == owner:
            rows = torch.empty(
                (r1 - r0, *self.shape[1:]), dtype=self.dtype, device=self.local.device
            )
        ops: list[dist.Work] = []
        for q in range(self.world_size):
            a, b = self._held(q)
            a, b = max(a, r0), min(b, r1)
            if a >= b or (q != self.rank and self.rank != owner):
                continue
            mine = self.local[a - q * self.chunk : b - q * self.chunk] if q == self.rank else None
            if q == self.rank == owner:
                assert rows is not None and mine is not None
                rows[a - r0 : b - r0].copy_(mine.detach())
            elif q == self.rank:
                assert mine is not None
                ops.append(_sent(dist.isend(mine.detach().contiguous(), dst=owner)))
            else:
                assert rows is not None
                ops.append(_sent(dist.irecv(rows[a - r0 : b - r0], src=q)))
        for op in ops:
            op.wait()
        if rows is None:
            return None
        start = lo - r0 * self.row_bytes
        return rows.reshape(-1).view(torch.uint8)[start : start + hi - lo], rows


def _sent(work: dist.Work | None) -> dist.Work:
    assert work is not None
    return work


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
