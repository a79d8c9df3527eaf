"""FSDP2 ranks (`trainer.strategy: fsdp`): the model sharded across the group, its full
weights gathered for rank 0 (which publishes and evaluates them), and the sharded
checkpoints every rank writes through torch.distributed.checkpoint (DCP).

Every function here that takes a sharded model is a collective: every rank of the group
calls it, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from robustrl.core.heartbeat import Progress
from services.trainer.grpo import local_shard


class CheckpointMismatch(ValueError):
    """A sharded checkpoint that does not fit the model it is read into (another model's, or
    not a DCP checkpoint at all)."""


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place over the default process group: each decoder layer is one FSDP
    unit (gathered for its forward and backward only), the root holds the rest (embeddings,
    final norm, head). Build the optimizer afterwards: it must hold the shards.

    Gradients are summed over the ranks, not averaged: each rank's loss is already divided by
    the whole batch's token count (ranks/step.py). Summed by plain SUM collectives, which gloo
    has (FSDP would otherwise pre-multiply, which gloo lacks).
    """
    units: list[FSDPModule] = []
    for layer in decoder_layers(model):
        units.append(fully_shard(layer))
    units.append(fully_shard(model))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # not in torch 2.11 (NCCL's)
            unit.set_force_sum_reduction_for_comms(True)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)


def local_numel(tensors: Iterable[torch.Tensor]) -> int:
    """Elements this rank holds of `tensors` (a DTensor's own shard only)."""
    return sum(local_shard(t).numel() for t in tensors)


def optimizer_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the optimizer state this rank holds (Adam's moments, its shard of them)."""
    return local_numel(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def report_held(
    progress: Progress, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """What this rank holds, as heartbeat counters: elements of the parameters
    (`held_params`) and of the optimizer state (`held_optimizer`). An FSDP2 rank of N holds
    about 1/N of each. Counted after a step until the optimizer holds state (it has none
    before its first step), and not again: the sizes do not change."""
    if progress.counters.get("held_optimizer"):
        return
    progress.counters = {
        **progress.counters,
        "held_params": float(local_numel(model.parameters())),
        "held_optimizer": float(optimizer_numel(optimizer)),
    }


def gather_full(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's weights, on the CPU of rank 0; an empty dict on the other ranks."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def broadcast_full(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Every rank's shards from rank 0's whole `state` (the other ranks pass {})."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup,
) -> Future[Any]:
    """Start writing this rank's shards of the model and optimizer to `path`; returns once
    they are copied off (DCP stages them), with the write going on in DCP's thread over
    `group` (its own gloo group, so the write's collectives never meet a step's). The future
    completes on rank 0 once every rank has written and DCP's `.metadata` is in place."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    future = dcp.async_save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(path),
        process_group=group,
    )
    assert isinstance(future, Future)
    return future


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, alone: bool
) -> None:
    """Read a DCP checkpoint into `model` and `optimizer`, whatever world size wrote it: DCP
    reads each rank's part of every tensor. `alone`: no process group (a single-rank job
    reading an FSDP job's checkpoint into a whole model)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(path),
            no_dist=alone,
        )
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        # DCP's error ends with the ranks' own, which names the key and shapes that differ.
        lines = [line for line in str(exc).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else repr(exc)
        raise CheckpointMismatch(f"{path}: not a checkpoint of this model: {why}") from exc
    # DCP loaded in place into these dicts' tensors.
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
