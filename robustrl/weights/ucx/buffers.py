"""The flat byte buffers that hold one model copy each: allocating them, handing host buffers
out again once nothing uses them, packing tensors into them and viewing tensors out of them.

A version's buffer holds its tensors at the offsets of its manifest (protocol.plan_layout);
bucket i is a slice of it. Pulls receive into such a buffer and publishers pack into one;
the tensors a pull returns are views of it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from robustrl.weights.protocol import BucketManifest, TensorEntry, tensor_dtype
from robustrl.weights.transport import NamedTensors


def allocate_buffer(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat byte buffer: one model copy.

    Host buffers come from numpy, which UCX receives into faster than into a torch-allocated
    buffer (docs/decisions/0110). Its contents are arbitrary: pack_into and the buckets set
    every byte.
    """
    if torch.device(device).type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


class HostBuffers:
    """Host buffers that pulls receive into and publishers pack into, each used again once no
    tensor refers to it.

    A fresh buffer's pages are faulted in and zero-filled by the kernel while it is first
    written, on the core that writes, inside the receive or the pack a trainer's step waits for
    (docs/decisions/0110). A buffer is handed out again only when every tensor made from it is
    gone (the version it held was dropped, the caller let go of the pulled tensors, UCX
    finished with it): torch wraps a numpy view of the pages, and a weak reference to that view
    dies with the last tensor. So a caller can never see its tensors change under it.

    At most `keep` buffers are remembered, in use or not; pulls and publishes never hold more
    memory than without reuse (the held versions and the one being filled; a relay drops a
    held version before it pulls, see HeldVersions.make_room), only keep it between them.
    CUDA buffers are not kept: torch's caching allocator already reuses device memory.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._known: list[tuple[np.ndarray, weakref.ref[np.ndarray]]] = []

    def take(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A buffer of nbytes with arbitrary contents (every byte is received or packed over)."""
        if torch.device(device).type != "cpu":
            return allocate_buffer(nbytes, device)
        free = [entry for entry in self._known if entry[1]() is None]
        reuse = next((pages for pages, _ in free if pages.nbytes == nbytes), None)
        # Free buffers of another size (the layout changed) would only hold memory.
        self._known = [entry for entry in self._known if entry[1]() is not None]
        pages = reuse if reuse is not None else np.empty(nbytes, dtype=np.uint8)
        handle = pages.view()
        self._known = [*self._known, (pages, weakref.ref(handle))][-self.keep :]
        return torch.from_numpy(handle)

    def clear(self) -> None:
        self._known = []


def pack_into(
    tensors: Sequence[tuple[str, torch.Tensor]],
    entries: Sequence[TensorEntry],
    buffer: torch.Tensor,
) -> None:
    """Copy each tensor's bytes to its offset in buffer (any device; one copy, no host hop)
    and zero the alignment gaps, so every byte is set whatever the buffer held before: the
    bucket checksums cover the gaps, and a relay packing the same tensors must match them."""
    end = 0
    for (name, tensor), entry in zip(tensors, entries, strict=True):
        if name != entry.name:
            raise ValueError(f"tensor {name!r} where the layout has {entry.name!r}")
        if entry.offset > end:
            buffer[end : entry.offset].zero_()
        end = entry.offset + entry.nbytes
        if entry.nbytes == 0:
            continue
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[entry.offset : end].copy_(flat)
    if buffer.numel() > end:
        buffer[end:].zero_()


def unpack_views(manifest: BucketManifest, buffer: torch.Tensor) -> NamedTensors:
    """The tensors as views of the verified buffer (no copy: the buffer is the model copy).

    One as_strided a tensor, on a view of the whole buffer as its dtype: cheaper, on every
    pull's path, than a slice, a view and a reshape a tensor (docs/decisions/0110). The entries
    were checked against the buffer's size when the manifest was read."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: NamedTensors = []
    for entry in manifest.tensors:
        dtype = tensor_dtype(entry)
        whole = typed.get(dtype)
        if whole is None:
            usable = buffer.numel() // dtype.itemsize * dtype.itemsize
            whole = typed[dtype] = buffer[:usable].view(dtype)
        strides = _contiguous_strides(entry.shape)
        out.append(
            (entry.name, whole.as_strided(entry.shape, strides, entry.offset // dtype.itemsize))
        )
    return out


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def bucket_view(manifest: BucketManifest, buffer: torch.Tensor, index: int) -> torch.Tensor:
    bucket = manifest.buckets[index]
    return buffer[bucket.offset : bucket.offset + bucket.nbytes]


def ucx_buffer(view: torch.Tensor) -> Any:
    """What ucxx sends from / receives into: numpy for host memory, the tensor itself on CUDA
    (ucxx reads __cuda_array_interface__)."""
    return view.numpy() if view.device.type == "cpu" else view
