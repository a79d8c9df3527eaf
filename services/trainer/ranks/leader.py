"""Rank 0's side of a trainer group: open the rendezvous store, wait for the other ranks (members
of their own, bound by the leader) to join, run each step on every rank, and tell them when
the job ends."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from services.trainer.grpo import GRPOTrainer, Sample, StepMetrics
from services.trainer.ranks.group import RankGroup
from services.trainer.ranks.sharding import (
    broadcast_full,
    load_sharded,
    report_held,
    save_sharded,
    shard_model,
)
from services.trainer.ranks.shares import PackedShare, ShareSettings, pack_group_share
from services.trainer.ranks.step import EvalOrder, SaveOrder, StepOrder, run_step

log = get_logger(__name__)


class GroupBroken(RuntimeError):
    """A collective of the group failed: another rank went away, froze past the timeout, or
    failed on its own. The group cannot be used again."""


class RanksDiverged(RuntimeError):
    """The ranks' parameters differ after a step: the data-parallel update is broken."""


class LeaderRanks:
    """Rank 0's side: host the rendezvous, run each step on every rank, end the group."""

    def __init__(
        self,
        progress: Progress,
        *,
        world_size: int,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        warn_after: float | None = None,
        backend: str = "gloo",
        sharded: bool = False,
        epoch: int = 0,
        address: str = "",
        shares: ShareSettings | None = None,
    ) -> None:
        """`host`: where the other ranks reach this rank's store (its advertise address).
        `sharded`: FSDP2 ranks (`sharding.py`). Rank 0 then trains its shards in a trainer
        of its own (`self.sharded`, its model sharded in place from the one it was started
        with), and after the start and each step every rank packs its share of the weights
        (`shares.py`, as `shares` says), which the worker publishes. `epoch` and `address`:
        `RankGroup`'s."""
        if sharded and shares is None:
            raise ValueError("FSDP2 ranks need ShareSettings to publish their weights")
        self.progress = progress
        self.is_sharded = sharded
        self.shares = shares
        self.sharded: GRPOTrainer | None = None
        """Rank 0's FSDP2 trainer (its shards); the worker trains and evaluates with it."""
        self.share: PackedShare | None = None
        """Rank 0's share of the weights after the start or the last step."""
        self.written: Future[Any] | None = None
        """This rank's part of the last sharded checkpoint (`save`); on rank 0 it completes
        once every rank's part is written."""
        self.group = RankGroup(
            0,
            world_size,
            f"{host}:0",
            progress,
            timeout_s,
            warn_after=warn_after,
            backend=backend,
            sharded=sharded,
            address=address,
            epoch=epoch,
        )
        self.started = False
        self.fingerprints: list[tuple[float, float]] = []
        """Each rank's parameter fingerprint after the last step."""

    def listen(self) -> str:
        """Open the rendezvous store; its host:port, for the other ranks."""
        return self.group.listen()

    def start(
        self,
        trainer: GRPOTrainer,
        *,
        check: Callable[[], None] | None = None,
        restore_from: Path | None = None,
        step: int = 0,
    ) -> None:
        """Wait for every rank to join (calling `check` meanwhile: it raises to give up), then
        give every rank rank 0's state. Blocks.

        `restore_from`: a sharded checkpoint every rank of an FSDP2 group reads its part of
        (a ddp group takes rank 0's state, restored already). `step`: the steps done, told to
        every rank (the version they publish first).
        """
        group = self.group
        before = self.progress.phase
        self.progress.enter("starting_ranks")
        try:
            group.init(check=check)
            if self.is_sharded:
                self._start_sharded(group, trainer, restore_from, step)
            else:
                group.broadcast_state(trainer.model, trainer.optimizer)
        except BaseException:
            group.close()
            raise
        finally:
            self.progress.enter(before)
        self.started = True

    def _start_sharded(
        self, group: RankGroup, trainer: GRPOTrainer, restore_from: Path | None, step: int
    ) -> None:
        # The whole state to hand out is read before sharding replaces the parameters; it
        # goes once the other ranks have their shards of it.
        state = trainer.model.state_dict() if restore_from is None else {}
        model = shard_model(trainer.model)
        self.sharded = GRPOTrainer(model, trainer.config, trainer.pad_id, autocast=trainer.autocast)
        start_sharded(group, self.sharded, str(restore_from or ""), state, step)
        del state
        self._pack()

    def _pack(self) -> None:
        """Every rank packs its share of the weights (rank 0's is kept to publish)."""
        assert self.sharded is not None and self.shares is not None
        self.share = pack_group_share(self.group, self.sharded.model, self.shares)

    def evaluate(self, generate: Callable[[torch.nn.Module, Callable[[bool], bool]], Any]) -> Any:
        """`generate(model, agree)` on every FSDP2 rank with its shards (rank 0's result is
        returned): `agree` keeps their forwards in step (TorchEngine.agree)."""
        if not self.started or self.sharded is None:
            raise RuntimeError("LeaderRanks.evaluate needs a started FSDP2 group")
        try:
            self.group.broadcast_batch(EvalOrder(self.sharded.steps_taken))
            return evaluate_rank(self.group, self.sharded.model, generate)
        except Exception as exc:
            raise GroupBroken(f"in an evaluation: {_first_line(exc)}") from exc

    def step(self, trainer: GRPOTrainer, samples: list[Sample], *, step: int) -> StepMetrics:
        """`trainer.step(samples)` across every rank, for the job's step `step + 1` (`step`:
        the steps done before it); the batch's metrics.

        `nonfinite_where` is rank 0's own: under data parallelism `nonfinite` may come from
        another rank, which reports its own counter. Raises `GroupBroken` if a collective
        fails, `RanksDiverged` if the ranks' parameters differ afterwards.
        """
        if not self.started:
            raise RuntimeError("LeaderRanks.start has not run")
        if not samples:
            raise ValueError("cannot train on an empty batch")
        order = StepOrder(step, list(samples))
        try:
            self.group.broadcast_batch(order)
            outcome = run_step(self.group, self.sharded or trainer, order)
            if self.sharded is not None:
                self._pack()
        except Exception as exc:
            raise GroupBroken(f"in step {step + 1}: {_first_line(exc)}") from exc
        self.fingerprints = outcome.fingerprints
        mine = self.sharded or trainer
        report_held(self.progress, mine.model, mine.optimizer)
        # FSDP2 ranks hold different shards: only whole copies can be compared.
        if self.sharded is None and any(
            fp != outcome.fingerprints[0] for fp in outcome.fingerprints
        ):
            raise RanksDiverged(
                f"ranks' parameters differ after step {step + 1}: {outcome.fingerprints}"
            )
        return outcome.metrics

    def save(self, step: int, path: Path) -> Future[Any]:
        """Every FSDP2 rank writes its shards of the state after `step` into `path`; returns
        once rank 0's are copied off, with a future that completes when every rank's part and
        DCP's metadata are written."""
        if not self.started or self.sharded is None:
            raise RuntimeError("LeaderRanks.save needs a started FSDP2 group")
        order = SaveOrder(step, str(path))
        try:
            self.group.broadcast_batch(order)
            self.written = save_rank(self.group, self.sharded, order, self.written)
        except Exception as exc:
            raise GroupBroken(f"in the checkpoint of step {step}: {_first_line(exc)}") from exc
        return self.written

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks the job's work is done, then leave the group; idempotent. A
        rank that does not hear it (gone, stopped) is the leader's to fence."""
        started, self.started = self.started, False
        if started and not self.group.broken:
            try:
                self.group.broadcast_batch(None, timeout_s=timeout_s)
            except Exception as exc:
                log.warning("trainer.ranks_stop_unheard", error=_first_line(exc))
        self.group.close()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)


def start_sharded(
    group: RankGroup,
    trainer: GRPOTrainer,
    restore_from: str,
    state: dict[str, Any],
    step: int = 0,
) -> int:
    """Every FSDP2 rank at the start: read its part of rank 0's sharded checkpoint, or take
    its shards of rank 0's whole `state` (the others pass {}). Returns the steps rank 0 has
    done (its `step`)."""
    restore_from, step = group.share_start(restore_from, step)
    with group.collective("broadcast_state"):
        if restore_from:
            load_sharded(trainer.model, trainer.optimizer, Path(restore_from), alone=False)
        else:
            broadcast_full(trainer.model, state if group.rank == 0 else {})
    return step


def evaluate_rank(
    group: RankGroup,
    model: torch.nn.Module,
    generate: Callable[[torch.nn.Module, Callable[[bool], bool]], Any],
) -> Any:
    """This FSDP2 rank's part of an evaluation: `generate(model, agree)`, its forwards kept in
    step with the other ranks' by `agree` (every row done on every rank)."""
    with group.collective("evaluate"):
        return generate(model, group.every_rank)


def save_rank(
    group: RankGroup, trainer: GRPOTrainer, order: SaveOrder, previous: Future[Any] | None
) -> Future[Any]:
    """This rank's part of a sharded checkpoint. The previous one's write finishes first:
    DCP's writes over the checkpoint group must not overlap."""
    assert group.checkpoint_group is not None
    if previous is not None:
        previous.result()
    with group.collective("save_checkpoint"):
        return save_sharded(
            trainer.model, trainer.optimizer, Path(order.path), group.checkpoint_group
        )
