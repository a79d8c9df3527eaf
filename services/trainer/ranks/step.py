"""One data-parallel step, as every rank runs it: the order rank 0 broadcasts, this rank's
shard of it, and the outcome gathered from every rank."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from services.trainer.grpo import GRPOTrainer, Sample, StepMetrics, local_shard

if TYPE_CHECKING:
    from services.trainer.ranks.group import RankGroup

T = TypeVar("T")


def shard(samples: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Rank `rank`'s part of one step's samples: every `world_size`-th from index `rank`.

    Strided rather than contiguous, so each rank gets a similar mix of groups and lengths.
    A rank may get none (fewer samples than ranks); it still joins the gradient sum.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return list(samples[rank::world_size])


@dataclass(frozen=True)
class StepOrder:
    """What rank 0 broadcasts each step: the step number and the whole batch."""

    step: int
    samples: list[Sample]


@dataclass(frozen=True)
class SaveOrder:
    """What rank 0 broadcasts for a sharded checkpoint (FSDP2): every rank writes its shards
    of the state after step `step` into `path` (`sharding.save_sharded`)."""

    step: int
    path: str


@dataclass(frozen=True)
class EvalOrder:
    """What rank 0 broadcasts for an evaluation of an FSDP2 group: every rank generates the
    held-out completions with its shards (each forward a collective); rank 0 scores them."""

    step: int


Order = StepOrder | SaveOrder | EvalOrder


@dataclass(frozen=True)
class StepOutcome:
    metrics: StepMetrics
    """The batch's metrics (summed over ranks), except `nonfinite_where`: this rank's."""
    fingerprints: list[tuple[float, float]]
    """Per rank, after the step: (sum, sum of squares) of the parameters it holds (an FSDP2
    rank: its shards), in float64."""


def fingerprint(model: torch.nn.Module) -> tuple[float, float]:
    """(sum, sum of squares) of every parameter this rank holds, in float64: equal on ddp
    ranks that agree."""
    total, squares = 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            flat = local_shard(p).detach().double()
            total += float(flat.sum())
            squares += float((flat * flat).sum())
    return total, squares


def run_step(
    group: RankGroup,
    trainer: GRPOTrainer,
    order: StepOrder,
    *,
    inject: Callable[[list[Sample]], list[Sample]] | None = None,
) -> StepOutcome:
    """This rank's part of one data-parallel step; every rank calls it with the same order.
    `trainer.model` is a whole copy (ddp) or this rank's FSDP2 shards (`group.sharded`).

    `inject` may change this rank's shard before it trains (deterministic failure
    injection, e.g. a NaN sample).
    """
    progress = group.progress
    mine = shard(order.samples, group.rank, group.world_size)
    if inject is not None:
        mine = inject(mine)
    tokens = sum(len(s.completion_ids) for s in order.samples)

    progress.enter("forward_backward")
    if group.sharded:
        # FSDP2 gathers each layer's shards in forward and backward and reduce-scatters its
        # gradients: collectives all through the step, so the step is one watched collective.
        passes = max(
            trainer.passes_for(shard(order.samples, r, group.world_size))
            for r in range(group.world_size)
        )
        with group.collective("fsdp_step"):
            local = trainer.step(
                mine,
                token_normaliser=tokens,
                sequence_normaliser=len(order.samples),
                before_optimizer=group.any_rank,
                passes=passes,
            )
    else:

        def before_optimizer(nonfinite: bool) -> bool:
            anywhere = group.sync_gradients(trainer.model, nonfinite=nonfinite)
            progress.enter("optimizer")
            return anywhere

        local = trainer.step(
            mine,
            token_normaliser=tokens,
            sequence_normaliser=len(order.samples),
            before_optimizer=before_optimizer,
        )
    rows = group.gather_step(
        [
            local.loss,
            local.ratio_mean,
            local.clip_frac,
            local.kl,
            float(local.num_tokens),
            float(local.num_samples),
            local.entropy,
            local.tis_capped,
            *fingerprint(trainer.model),
        ]
    )
    summed = [math.fsum(column) for column in zip(*(row[:8] for row in rows), strict=True)]
    metrics = dataclasses.replace(
        local,
        loss=summed[0],
        ratio_mean=summed[1],
        clip_frac=summed[2],
        kl=summed[3],
        num_tokens=int(summed[4]),
        num_samples=int(summed[5]),
        entropy=summed[6],
        tis_capped=summed[7],
    )
    return StepOutcome(metrics, [(row[8], row[9]) for row in rows])
