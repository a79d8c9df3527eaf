"""Rank 0's side of a data-parallel job: start the followers, run each step on every rank,
name the rank that went away when a step breaks, and stop them."""

from __future__ import annotations

import copy
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from services.trainer.grpo import GRPOTrainer, Sample, StepMetrics
from services.trainer.ranks.followers import spawn_followers, stop_followers
from services.trainer.ranks.group import RankGroup
from services.trainer.ranks.sharding import (
    broadcast_full,
    load_sharded,
    save_sharded,
    shard_model,
)
from services.trainer.ranks.step import SaveOrder, StepOrder, run_step

log = get_logger(__name__)

RANK_EXIT_GRACE = 2.0
"""How long rank 0, its collective broken, waits for a follower to exit to name it as the
cause (a follower that failed closes its connections, then exits)."""


class RankExited(RuntimeError):
    """A follower rank ended while rank 0 worked with it: the step (or start) cannot finish."""


class RanksDiverged(RuntimeError):
    """The ranks' parameters differ after a step: the data-parallel update is broken."""


class LeaderRanks:
    """Rank 0's side: start the followers, run each step on every rank, stop them."""

    def __init__(
        self,
        progress: Progress,
        *,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        warn_after: float | None = None,
        backend: str = "gloo",
        sharded: bool = False,
    ) -> None:
        """`sharded`: FSDP2 ranks (`sharding.py`). Rank 0 then trains its shards in a trainer
        of its own (`self.sharded`), and after each step gathers the whole weights into the
        trainer it was started with, which the worker publishes and evaluates."""
        self.progress = progress
        self.timeout_s = timeout_s
        self.host = host
        self.warn_after = warn_after
        self.backend = backend
        self.is_sharded = sharded
        self.sharded: GRPOTrainer | None = None
        """Rank 0's FSDP2 trainer (its shards), next to the whole model it publishes."""
        self.written: Future[Any] | None = None
        """This rank's part of the last sharded checkpoint (`save`); on rank 0 it completes
        once every rank's part is written."""
        self.group: RankGroup | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.fingerprints: list[tuple[float, float]] = []
        """Each rank's parameter fingerprint after the last step."""

    def start(
        self,
        trainer: GRPOTrainer,
        *,
        spec_path: Path,
        job_id: str,
        world_size: int,
        etcd: EtcdSettings,
        instance_id: str,
        settings: ServiceSettings | None = None,
        torch_threads: int = 1,
        follower_args: Mapping[int, Sequence[str]] | None = None,
        restore_from: Path | None = None,
    ) -> None:
        """Spawn the followers, form the group, give every rank rank 0's state. Blocks.

        `spec_path` holds the JobSpec as JSON (the followers load the same model).
        `restore_from`: a sharded checkpoint every rank of an FSDP2 group reads its part of
        (a ddp group takes rank 0's state, restored already).
        """
        group = RankGroup(
            0,
            world_size,
            f"{self.host}:0",
            self.progress,
            self.timeout_s,
            warn_after=self.warn_after,
            backend=self.backend,
            sharded=self.is_sharded,
        )
        before = self.progress.phase
        self.progress.enter("starting_ranks")
        try:
            master = group.listen()
            self.procs = spawn_followers(
                job_id=job_id,
                world_size=world_size,
                master=master,
                spec_path=spec_path,
                etcd=etcd,
                instance_id=instance_id,
                settings=settings,
                torch_threads=torch_threads,
                timeout_s=self.timeout_s,
                extra_args=follower_args,
            )
            # Rank 0's copy to shard is made before the group forms (the others wait in its
            # first collective from then on).
            whole = copy.deepcopy(trainer.model) if self.is_sharded else None
            group.init(check=self._check_followers)
            if whole is not None:
                self._start_sharded(group, trainer, whole, restore_from)
            else:
                group.broadcast_state(trainer.model, trainer.optimizer)
        except BaseException:
            stop_followers(self.procs, 0.0)
            self.procs = []
            group.close()
            raise
        finally:
            self.progress.enter(before)
        self.group = group

    def _start_sharded(
        self,
        group: RankGroup,
        trainer: GRPOTrainer,
        whole: torch.nn.Module,
        restore_from: Path | None,
    ) -> None:
        model = shard_model(whole)
        self.sharded = GRPOTrainer(model, trainer.config, trainer.pad_id, autocast=trainer.autocast)
        state = trainer.model.state_dict()
        trainer.model.load_state_dict(
            start_sharded(group, self.sharded, str(restore_from or ""), state)
        )

    def _gather_into(self, group: RankGroup, trainer: GRPOTrainer) -> None:
        """The whole weights of the shards into rank 0's `trainer.model` (every rank joins)."""
        assert self.sharded is not None
        full = group.gather_weights(self.sharded.model)
        trainer.model.load_state_dict(full)

    def _check_followers(self) -> None:
        exited = self._exited()
        if exited:
            raise RankExited(f"{exited} before joining")

    def _exited(self, wait_s: float = 0.0) -> str:
        """Which followers have exited, and how ("trainer rank 1 exited with code 1"); empty if
        none has. Waits up to `wait_s` for one to: a rank that failed exits just after its
        connections close, and the other ranks learn of it from those."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = [(rank, proc.poll()) for rank, proc in enumerate(self.procs, start=1)]
            exited = [
                f"trainer rank {rank} exited with code {code}"
                for rank, code in codes
                if code is not None
            ]
            if exited or time.monotonic() >= deadline:
                return ", ".join(exited)
            time.sleep(0.05)

    def step(self, trainer: GRPOTrainer, samples: Sequence[Sample], *, step: int) -> StepMetrics:
        """`trainer.step(samples)` across every rank; the batch's metrics.

        `nonfinite_where` is rank 0's own: under data parallelism `nonfinite` may come from
        another rank, which reports its own counter. Raises `RanksDiverged` if the ranks'
        parameters differ afterwards.
        """
        if self.group is None:
            raise RuntimeError("LeaderRanks.start has not run")
        if not samples:
            raise ValueError("cannot train on an empty batch")
        order = StepOrder(step, list(samples))
        try:
            self.group.broadcast_batch(order)
            outcome = run_step(self.group, self.sharded or trainer, order)
            if self.sharded is not None:
                self._gather_into(self.group, trainer)
        except Exception as exc:
            # gloo says only that a connection broke; name the rank that went away (its own
            # log, trainer.follower_failed, says why) so the recovery record does too.
            exited = self._exited(wait_s=RANK_EXIT_GRACE)
            if exited:
                first = str(exc).splitlines()[0] if str(exc) else repr(exc)
                raise RankExited(f"in step {step + 1}: {exited} ({first})") from exc
            raise
        self.fingerprints = outcome.fingerprints
        # FSDP2 ranks hold different shards: only whole copies can be compared.
        if self.sharded is None and any(
            fp != outcome.fingerprints[0] for fp in outcome.fingerprints
        ):
            raise RanksDiverged(
                f"ranks' parameters differ after step {step}: {outcome.fingerprints}"
            )
        return outcome.metrics

    def save(self, step: int, path: Path) -> Future[Any]:
        """Every FSDP2 rank writes its shards of the state after `step` into `path`; returns
        once rank 0's are copied off, with a future that completes when every rank's part and
        DCP's metadata are written."""
        if self.group is None or self.sharded is None:
            raise RuntimeError("LeaderRanks.save needs a started FSDP2 group")
        order = SaveOrder(step, str(path))
        try:
            self.group.broadcast_batch(order)
            self.written = save_rank(self.group, self.sharded, order, self.written)
        except Exception as exc:
            exited = self._exited(wait_s=RANK_EXIT_GRACE)
            if exited:
                raise RankExited(f"in the checkpoint of step {step}: {exited}") from exc
            raise
        return self.written

    def close(self, timeout_s: float = 10.0) -> list[int]:
        """Tell the followers to exit, wait for them, stop those that do not; idempotent.

        Returns the followers' exit codes.
        """
        group, self.group = self.group, None
        if group is not None and not group.broken:
            try:
                group.broadcast_batch(None, timeout_s=timeout_s)
            except Exception as exc:  # a follower is gone or stopped: it is stopped below
                log.warning("trainer.ranks_stop_unheard", error=str(exc).splitlines()[0])
        codes = stop_followers(self.procs, timeout_s)
        if group is not None:
            group.close()
        if self.procs:
            log.info("trainer.ranks_closed", exit_codes=codes)
        self.procs = []
        return codes


def start_sharded(
    group: RankGroup, trainer: GRPOTrainer, restore_from: str, state: dict[str, Any]
) -> dict[str, Any]:
    """Every FSDP2 rank at the start: read its part of rank 0's sharded checkpoint, or take
    its shards of rank 0's whole `state` (the others pass {}). Returns the whole weights
    started from on rank 0 (gathered from the shards), {} on the others."""
    restore_from = group.share_start(restore_from)
    with group.collective("broadcast_state"):
        if restore_from:
            load_sharded(trainer.model, trainer.optimizer, Path(restore_from), alone=False)
        else:
            broadcast_full(trainer.model, state if group.rank == 0 else {})
    return group.gather_weights(trainer.model)


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
