"""Reading checkpoints back: one folder, the one the newest epoch's pointer names, and the
restore of its state into a model, an optimizer and the RNGs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from services.trainer.checkpoint import folder
from services.trainer.checkpoint.folder import CheckpointError
from services.trainer.checkpoint.snapshot import RngState, restore_rng, rng_from_plain
from services.trainer.ranks.sharding import load_sharded


@dataclass(frozen=True)
class Checkpoint:
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    """Both empty for a sharded checkpoint: its ranks' parts are read where they go."""
    rng: RngState
    extra: dict[str, Any]
    path: Path
    sharded: bool = False
    """Written by FSDP2 ranks through torch.distributed.checkpoint (`restore` reads it)."""


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read one ``step-<N>`` directory; CheckpointError if it is incomplete or unreadable."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != folder.FORMAT_VERSION:
            raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
        sharded = bool(meta.get("sharded", False))
        if sharded and not (path / ".metadata").is_file():
            raise CheckpointError(f"{path}: a sharded checkpoint without DCP's .metadata")
        return Checkpoint(
            step=int(meta["step"]),
            model_state={} if sharded else load_file(str(path / "model.safetensors")),
            optimizer_state=(
                {} if sharded else torch.load(path / "optimizer.pt", weights_only=True)
            ),
            rng=rng_from_plain(torch.load(path / "rng.pt", weights_only=True)),
            extra=dict(meta.get("extra", {})),
            path=path,
            sharded=sharded,
        )
    except CheckpointError:
        raise
    except Exception as e:  # safetensors, pickle and json all have their own error types
        raise CheckpointError(f"{path}: not a readable checkpoint: {e!r}") from e


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The checkpoint the newest epoch's pointer names, or None when nothing was written (or
    the newest epoch claimed the directory before anything was)."""
    directory = Path(directory)
    found = folder.newest_pointer(directory)
    if found is None or not found[1]:
        return None
    pointer, name = found
    if not folder.STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: does not name a checkpoint: {name!r}")
    target = directory / name
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is missing from {directory}")
    return load_checkpoint(target)


def restore(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
) -> int:
    """Load a checkpoint into ``model`` (strictly), ``optimizer`` and the RNGs; returns its step.

    A sharded checkpoint restores into a whole model here (every rank's part read in this
    process); FSDP2 ranks read their own parts instead (ranks/sharding.py).
    """
    if checkpoint.sharded:
        if optimizer is None:
            raise CheckpointError(
                f"{checkpoint.path}: a sharded checkpoint restores with its optimizer"
            )
        try:
            load_sharded(model, optimizer, checkpoint.path, alone=True)
        except Exception as e:  # DCP's errors name the keys that do not fit
            raise CheckpointError(f"{checkpoint.path}: does not fit this model: {e}") from e
    else:
        model.load_state_dict(checkpoint.model_state, strict=True)
    if optimizer is not None and not checkpoint.sharded:
        optimizer.load_state_dict(checkpoint.optimizer_state)
    if rng:
        restore_rng(checkpoint.rng)
    return checkpoint.step
