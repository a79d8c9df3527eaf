"""A training step's state copied into CPU memory: the part of a checkpoint that blocks the
step. The RNG state is kept in plain containers on disk, so it loads with
``torch.load(weights_only=True)``."""

from __future__ import annotations

import json
import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RngState:
    """Every random generator a training step draws from."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]


def capture_rng() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return RngState(
        torch_cpu=torch.random.get_rng_state().clone(),
        torch_cuda=[s.clone() for s in cuda],
        python=random.getstate(),
        numpy=tuple(np.random.get_state()),
    )


def restore_rng(state: RngState) -> None:
    torch.random.set_rng_state(state.torch_cpu)
    if state.torch_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state.torch_cuda)
    random.setstate(state.python)
    np.random.set_state(state.numpy)


def rng_to_plain(state: RngState) -> dict[str, Any]:
    # Plain containers only, so the file loads with torch.load(weights_only=True).
    version, internal, gauss = state.python
    name, keys, pos, has_gauss, cached = state.numpy
    return {
        "torch_cpu": state.torch_cpu,
        "torch_cuda": list(state.torch_cuda),
        "python": [version, list(internal), gauss],
        "numpy": [
            str(name),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
    }


def rng_from_plain(d: dict[str, Any]) -> RngState:
    version, internal, gauss = d["python"]
    name, keys, pos, has_gauss, cached = d["numpy"]
    return RngState(
        torch_cpu=d["torch_cpu"],
        torch_cuda=list(d["torch_cuda"]),
        python=(version, tuple(internal), gauss),
        numpy=(name, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
    )


@dataclass(frozen=True)
class Snapshot:
    """Training state copied to CPU memory: safe to write while training goes on."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: RngState
    extra: dict[str, Any]


@dataclass(frozen=True)
class ShardedSnapshot:
    """A checkpoint FSDP2 ranks are writing (torch.distributed.checkpoint) into `folder`, a
    temporary folder of the checkpoint directory (`folder.new_tmp`): the model and optimizer
    shards of every rank are copied off already, and `written` completes once every rank's
    part and DCP's metadata are on disk. The writer then adds rank 0's RNG and the meta."""

    step: int
    folder: Path
    written: Future[Any]
    rng: RngState
    extra: dict[str, Any]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def json_copy(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`extra` copied through JSON (later changes by the caller do not leak into a snapshot);
    ValueError unless it is a JSON object."""
    try:
        copied = json.loads(json.dumps(extra or {}, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from e
    if not isinstance(copied, dict):
        raise ValueError("checkpoint extra must be a JSON object")
    return copied


def to_host(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rng_state: RngState | None = None,
    extra: dict[str, Any] | None = None,
) -> Snapshot:
    """Copy the state of a step into CPU memory (the blocking part of a checkpoint).

    ``rng_state`` defaults to the generators' state now. ``extra`` must be JSON-serialisable;
    it is copied, so later changes by the caller do not leak into the snapshot.
    """
    extra_copy = json_copy(extra)
    return Snapshot(
        step=step,
        model_state={
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()
        },
        optimizer_state=_to_cpu(optimizer.state_dict()),
        rng=rng_state if rng_state is not None else capture_rng(),
        extra=extra_copy,
    )
