"""Trainer ranks 1..N-1: what a trainer member bound as rank r > 0 does. The worker
(services/trainer/worker.py) finds rank 0's store through the rendezvous in etcd and runs
`follow` in a thread of its own.

It joins the group with the model its worker loaded from `model.path`, and takes rank 0's
parameters and optimizer state (an FSDP2 rank shards first and takes its shards, or reads its
part of rank 0's sharded checkpoint). For every batch rank 0 broadcasts, it trains its shard
and joins the gradient sum, in the same phases as rank 0 and with rank 0's `step` counter; an
FSDP2 rank then packs its share of the weights, which its worker serves. A checkpoint order
writes its part; an evaluation order generates with its shards, as rank 0 does. A `None`
order ends the job's work: `follow` returns, and the member stays bound until the leader
releases it. A broken group (rank 0 gone, another rank failed) raises: the leader fences the
whole group and binds a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from robustrl.contracts.jobspec import JobSpec
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from robustrl.core.runtime import long_lived_objects

if TYPE_CHECKING:
    import torch

    from services.trainer.grpo import GRPOTrainer, Sample
    from services.trainer.ranks import PackedShare, RankGroup, ShareSettings, StepOrder

log = get_logger(__name__)

StepHook = Callable[["StepOrder"], None]
"""Called with each step's order before the rank trains it (failure injection)."""

ShareHook = Callable[[int, "PackedShare"], None]
"""Called with each version this FSDP2 rank packed its share of (the steps done), and the
share: the rank serves it once rank 0 has published the version's manifest."""


class RankFailed(RuntimeError):
    """This rank stopped with an error (injected by `faults.error_steps` on `error_rank`)."""


def make_trainer(spec: JobSpec, rank: int, model: torch.nn.Module, pad_id: int) -> GRPOTrainer:
    """The GRPO trainer of `model`; an fsdp job's shards it first (the group must be up)."""
    from services.trainer.devices import compute_for
    from services.trainer.grpo import GRPOTrainer, grpo_config
    from services.trainer.ranks.sharding import shard_model

    if spec.trainer.strategy == "fsdp":
        model = shard_model(model)
    autocast = compute_for(spec.trainer, rank).autocast
    return GRPOTrainer(model, grpo_config(spec), pad_id=pad_id, autocast=autocast)


def _nan_injector(
    spec: JobSpec, rank: int, step: int
) -> Callable[[list[Sample]], list[Sample]] | None:
    """spec.faults on this rank: this step's first sample gets a NaN advantage."""
    faults = spec.faults
    if faults.nan_rank != rank or step + 1 not in faults.nan_loss_steps:
        return None

    def poison(samples: list[Sample]) -> list[Sample]:
        if not samples:
            return samples
        log.warning("trainer.fault_injected", step=step + 1, rank=rank, fault="nan")
        return [dataclasses.replace(samples[0], advantage=float("nan")), *samples[1:]]

    return poison


def _count_nonfinite(progress: Progress, where: str, step: int) -> None:
    name = f"nonfinite_{where}"
    progress.set_counter(name, progress.counters.get(name, 0.0) + 1)
    progress.set_counter("step", float(step))
    log.error("trainer.nonfinite", step=step, rank=progress.rank, where=where)
    progress.urge()


def follow(
    group: RankGroup,
    spec: JobSpec,
    model: torch.nn.Module,
    tokenizer: Any,
    progress: Progress,
    *,
    shares: ShareSettings | None = None,
    on_share: ShareHook | None = None,
    before_step: StepHook | None = None,
) -> None:
    """Join `group` as its rank and do what rank 0 says until it says the work is done; raises
    if the group breaks. Leaves the group either way. Blocks.

    An FSDP2 rank packs its share of the weights after the start and after each step (as
    `shares` says) and hands it to `on_share` with the version it is (the steps done)."""
    from services.trainer import ranks
    from services.trainer.evaluation import Evaluation

    rank, sharded = group.rank, spec.trainer.strategy == "fsdp"
    if sharded and shares is None:
        raise ValueError("an FSDP2 rank needs ShareSettings to publish its share")
    written: Future[Any] | None = None
    evaluation = Evaluation.for_job(spec) if sharded else None

    def generate(model: torch.nn.Module, agree: Callable[[bool], bool]) -> None:
        assert evaluation is not None
        evaluation.generate(model, tokenizer, agree)  # rank 0 scores its own

    def pack(version: int) -> None:
        assert shares is not None
        packed = ranks.pack_group_share(group, trainer.model, shares)
        if on_share is not None:
            on_share(version, packed)

    try:
        progress.enter("starting_ranks")
        group.init()
        with long_lived_objects(start=True):
            trainer = make_trainer(spec, rank, model, int(tokenizer.pad_token_id))
        if sharded:
            pack(ranks.start_sharded(group, trainer, "", {}))
        else:
            group.broadcast_state(trainer.model, trainer.optimizer)
        while True:
            progress.enter("waiting_data")
            order = group.broadcast_batch(None)
            if order is None:
                if written is not None:
                    written.result()  # this rank's part of the last checkpoint is on disk
                progress.enter("done")
                log.info("trainer.rank_done", rank=rank)
                return
            if isinstance(order, ranks.SaveOrder):
                progress.enter("checkpoint")
                written = ranks.save_rank(group, trainer, order, written)
                continue
            if isinstance(order, ranks.EvalOrder):
                progress.enter("eval")
                ranks.evaluate_rank(group, trainer.model, generate)
                continue
            if before_step is not None:
                before_step(order)
            if rank == spec.faults.error_rank and order.step + 1 in spec.faults.error_steps:
                progress.enter("forward_backward")
                log.warning("trainer.fault_injected", step=order.step + 1, fault="error")
                raise RankFailed(f"rank {rank} failed in step {order.step + 1} (injected fault)")
            outcome = ranks.run_step(
                group, trainer, order, inject=_nan_injector(spec, rank, order.step)
            )
            if sharded:
                pack(order.step + 1)
            if outcome.metrics.nonfinite_where:
                _count_nonfinite(progress, outcome.metrics.nonfinite_where, order.step + 1)
            ranks.report_held(progress, trainer.model, trainer.optimizer)
            progress.set_counter("step", float(order.step + 1))
    finally:
        group.close()
