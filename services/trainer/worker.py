"""One job on a trainer: load the model, take trajectories in, run GRPO steps, checkpoint,
publish weight versions, evaluate, and report progress to the coordinator.

A trainer bound as rank r > 0 of a group (`trainer.world_size` > 1) runs no step loop: it
finds rank 0 through the rendezvous in etcd and does what rank 0 says (`rank_group.py`,
`follower.py`).

This module is the step loop and the state it keeps; each step's parts are their own rooms:
`batches` (samples and metrics), `publishing` (weights), `checkpoint` (the writer and the
restore), `evaluation`, `reporting` (to the coordinator), `acks` (to the rollouts) and
`run_logs` (the run folder). The step loop runs torch in a worker thread so the event loop
keeps serving trajectory streams, weight pulls and heartbeats while a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.contracts.errors import Fenced, InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.aio import cancel_and_wait
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.fences import FenceSet
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime, long_lived_objects
from robustrl.generation.engine import ContextExceeded
from robustrl.generation.rewards import RewardError
from robustrl.generation.serving import TensorSpec, check_form, checkpoint_specs
from robustrl.generation.tasks import UnknownTaskError
from robustrl.v1 import coordinator_pb2, trainer_pb2
from robustrl.weights import WeightTransport, warm_up_ucxx
from services.trainer import checkpoint, grpo
from services.trainer.acks import RolloutAcks
from services.trainer.batches import InjectedError, step_inputs, step_metrics
from services.trainer.config import TrainerSettings
from services.trainer.devices import Compute, compute_for
from services.trainer.evaluation import Evaluation
from services.trainer.intake import Group, Intake, TrainedGroups
from services.trainer.publishing import (
    open_transport,
    publish_share,
    publish_weights,
    share_settings,
)
from services.trainer.rank_group import HostedGroup, follow_group
from services.trainer.ranks import GroupBroken
from services.trainer.reporting import report_to_coordinator, report_until_heard
from services.trainer.run_logs import RunLogs

log = get_logger(__name__)

# Trainer phases while it waits on something outside it: no phase budget applies (a hang
# budget would replace a healthy trainer for an etcd or coordinator outage).
WAITING_ETCD = "waiting_etcd"
WAITING_COORDINATOR = "waiting_coordinator"
STOPPED_ON_ERROR = "stopped_on_error"
"""Phase of a trainer whose step loop ended on an error: it waits to be fenced and replaced."""

GROUP_LOSS_GRACE_S = 10.0
"""How long rank 0, its group broken, waits to be fenced before it reports the break as its own
error: the rank that went away (killed, its host lost) is the likelier cause, and the monitor's
report of it fences the whole group anyway, naming the right member."""

JOB_ERRORS = (RewardError, InvalidArgument, UnknownTaskError, ContextExceeded)
"""Errors in the job itself (its reward plug-in, its spec, its prompts): another trainer would
stop the same way, so the job fails at once. Any other error is taken as this trainer's
machine failing, and recovered on another trainer (coordinator/policy/verdicts.py)."""


class TrainerWorker:
    def __init__(
        self,
        runtime: ServiceRuntime,
        settings: TrainerSettings,
        *,
        job_id: str,
        epoch: int,
        spec: JobSpec,
    ) -> None:
        self.runtime = runtime
        self.settings = settings
        self.job_id = job_id
        self.epoch = epoch
        self.spec = spec
        self.run_logs = RunLogs(Path(settings.runs_dir) / job_id, job_id)
        self.intake = Intake(job_id, spec.trainer.max_staleness)
        self.acks = RolloutAcks(job_id)
        self.step = 0
        self.durable_step = 0
        """Steps [0, durable_step) are in a durable checkpoint (written, or restored from)."""
        self.restored_step = 0
        """The step of the checkpoint this trainer restored (0: it started afresh)."""
        self.saved_step = 0
        """The step of the last checkpoint this trainer handed to its writer."""
        self.rank = 0
        """This trainer's rank in the job's group (set at BIND): rank 0 runs the step loop."""
        self.nan_steps: set[int] = set(spec.faults.nan_loss_steps)
        self.error_steps: set[int] = (
            set(spec.faults.error_steps) if spec.faults.error_rank == 0 else set()
        )
        self.data_arrived = asyncio.Event()
        self.transport: WeightTransport | None = None
        self.group: HostedGroup | None = None
        """Rank 0's side of the group (spec.trainer.world_size > 1, or an fsdp job)."""
        self.sharded = spec.trainer.strategy == "fsdp"
        """FSDP2 ranks: once the group has started, `self.model` is rank 0's shards (sharded
        in place), each rank publishes its share of every version and the ranks evaluate
        together."""
        self.restore_from: Path | None = None
        """The sharded checkpoint the FSDP2 ranks read at their start."""
        self.compute: Compute | None = None
        self.fences: FenceSet | None = None
        assert runtime.client is not None
        self.coordinator = CoordinatorClient(runtime.client, runtime.keys)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Filled by prepare() and load():
        self.model: Any = None
        self.serving_form: dict[str, TensorSpec] = {}
        """What each version is published as: the checkpoint's tensors (generation/serving.py)."""
        self.tokenizer: Any = None
        self.trainer: grpo.GRPOTrainer | None = None
        self.evaluation: Evaluation | None = None
        self.checkpoints: checkpoint.CheckpointWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def run_dir(self) -> Path:
        return self.run_logs.run_dir

    @property
    def progress(self) -> Progress:
        return self.runtime.progress

    # ------------------------------------------------------------------ set-up

    def prepare(self) -> None:
        """Build what does not depend on the job's progress (model, tokenizer, optimizer,
        reward); a warm standby does this ahead of its BIND. InvalidArgument naming the spec
        field on bad input. Done once: a second call returns at once."""
        if self.trainer is not None:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.settings.torch_threads)
        spec = self.spec
        self.compute = compute_for(spec.trainer)
        if self.compute.device.type == "cuda":
            torch.cuda.set_device(self.compute.device)
        path = Path(spec.model.path)
        if not (path / "config.json").exists():
            raise InvalidArgument(
                f"model.path: no model at {path} (run `robustrl model init` to create the tiny one)"
            )
        self.evaluation = Evaluation.for_job(spec)
        torch.manual_seed(spec.seed)
        with long_lived_objects():
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            # fp32 master weights whatever the checkpoint's dtype; versions are published in
            # the checkpoint's (docs/decisions/0406).
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            self.model.to(self.compute.device)
        try:
            self.serving_form = checkpoint_specs(path)
            check_form(self.model, self.serving_form)  # at the start, without a copy
        except ValueError as exc:
            raise InvalidArgument(f"model.path: {exc}") from exc
        self.trainer = grpo.GRPOTrainer(
            self.model,
            grpo.grpo_config(spec),
            pad_id=int(self.tokenizer.pad_token_id),
            autocast=self.compute.autocast,
        )
        if spec.trainer.weight_transport == "ucx":
            warm_up_ucxx()

    def load(self) -> None:
        """Everything the job needs: `prepare` (if not done ahead), the checkpoint writer and
        the restore from the job's latest checkpoint, read now. The writer is not made ahead:
        it claims the folder for this trainer's epoch (a fenced trainer's writer publishes
        nothing after that) and clears the unfinished writes it finds, and a standby's must
        not do either while the trainer it stands by for still runs. A rank > 0 needs only the
        model, on its own device: rank 0 gives it the state to start from."""
        self.prepare()
        assert self.trainer is not None
        if not 0 <= self.rank < self.spec.trainer.world_size:
            raise InvalidArgument(
                f"rank {self.rank} does not exist in a group of trainer.world_size "
                f"{self.spec.trainer.world_size}"
            )
        if self.rank > 0:
            self.compute = compute_for(self.spec.trainer, self.rank)
            if self.compute.device.type == "cuda":
                # Its own GPU for what runs on "the current device" too (NCCL, new tensors),
                # not cuda:0, which rank 0 of a multi-GPU host computes on.
                torch.cuda.set_device(self.compute.device)
            self.model.to(self.compute.device)
            return
        if self.epoch == FIRST_EPOCH:
            self.run_logs.set_aside_earlier_run()
        self.checkpoints = checkpoint.CheckpointWriter(
            self.run_dir / "checkpoints",
            keep=self.settings.keep_checkpoints,
            on_written=self._on_written,
            epoch=self.epoch,
        )
        self.run_logs.owner = self.checkpoints
        restored = checkpoint.load_latest(self.run_dir / "checkpoints")
        if restored is not None and self.sharded:
            if not restored.sharded:
                raise InvalidArgument(
                    f"trainer.strategy: fsdp restores sharded checkpoints, and {restored.path} "
                    "holds a whole model (a ddp job's)"
                )
            # Every rank reads its own part when the ranks start (ranks/sharding.py).
            self.restore_from = restored.path
            checkpoint.restore_rng(restored.rng)
        if restored is not None:
            if not self.sharded:
                checkpoint.restore(restored, self.model, self.trainer.optimizer)
            self.step = restored.step
            self.durable_step = self.restored_step = self.saved_step = self.step
            self.intake.trained_groups = TrainedGroups.from_json(
                restored.extra.get("trained_groups", [])
            )
            self.intake.restored_step = self.step
            self.run_logs.forget_after(self.step)
            log.info("trainer.restored", job=self.job_id, step=self.step, epoch=self.epoch)
        else:
            # An earlier trainer of this job died before its first checkpoint: its steps are
            # trained again from step 0, and the evaluation before training is made again. (A
            # first trainer's folder was set aside: it has no logs to forget.)
            self.run_logs.forget_after(None)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        work = self._run() if self.rank == 0 else self._follow()
        self._task = asyncio.create_task(work, name=f"train-{self.job_id}-rank{self.rank}")

    def abandon_checkpoints(self) -> None:
        """This trainer was fenced: it writes no more checkpoints (`CheckpointWriter.abandon`)."""
        if self.checkpoints is not None:
            self.checkpoints.abandon()

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._task)
        await self._close_ranks()
        if self.fences is not None:
            await self.fences.stop()
        if self.transport is not None:
            await self.transport.close()
        if self.checkpoints is not None:
            await asyncio.to_thread(self.checkpoints.close)
        await self.coordinator.close_channels()

    # ------------------------------------------------------------------ intake

    def offer(self, trajectory: trainer_pb2.Trajectory) -> tuple[str, str]:
        if self.fences is not None and self.fences.fences(
            trajectory.rollout_instance_id, self.job_id, trajectory.rollout_epoch
        ):
            return "rejected", f"rollout {trajectory.rollout_instance_id} was fenced"
        verdict = self.intake.offer(trajectory)
        if verdict[0] == "received":
            self.data_arrived.set()
        return verdict

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        spec = self.spec
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            assert self.runtime.client is not None
            self.fences = FenceSet(self.runtime.client, self.runtime.keys)
            self.fences.start()
            self.transport = await open_transport(self.runtime, spec, self.job_id, self.epoch)
            log.info("trainer.weights_transport", kind=self.transport.name)
            if spec.trainer.world_size > 1 or self.sharded:
                await self._start_ranks()
            await self._publish()
            if self.step == 0:
                self.run_logs.record(self.step, {"eval_reward": await self._evaluate()})
            last = time.monotonic()
            # ETTR: a kept step stands for the time since the previous one ended (or since this
            # trainer became ready), within a bound on the wait for data (coordinator/ettr.py);
            # the time before a restored trainer was ready is not part of it.
            previous_end = time.time()
            # self.spec, not spec: the step budget can change while the job runs (`_report`).
            while self.step < self.spec.trainer.steps and not self._stopping:
                batch, stale = self.intake.take_batch(self.step, spec.trainer.groups_per_step)
                dropped = self.acks.reject(stale)
                if not batch:
                    if dropped or self.intake.regenerate:
                        await self._report({}, [], dropped)
                    if self.progress.phase != "waiting_data":
                        self.progress.enter("waiting_data")
                    self.data_arrived.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.data_arrived.wait(), 1.0)
                    continue
                work_started = time.time()
                metrics = await self._train(batch)
                elapsed = time.monotonic() - last
                last = time.monotonic()
                metrics["tokens_per_s"] = metrics["tokens"] / max(elapsed, 1e-6)
                metrics["step_seconds"] = elapsed
                if self.compute is not None and self.compute.device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(self.compute.device)
                    metrics["gpu_peak_mib"] = peak / 2**20
                await self._publish()
                await self._checkpoint()
                if self.step % spec.trainer.eval_every == 0 or self.step == self.spec.trainer.steps:
                    metrics["eval_reward"] = await self._evaluate()
                metrics["step_started_at"] = previous_end
                metrics["step_work_started_at"] = work_started
                metrics["step_ended_at"] = previous_end = time.time()
                self.run_logs.record(self.step, metrics)
                keep_going = await self._report(metrics, [g.group_id for g in batch], dropped)
                if not keep_going:
                    return
            if self.step > self.saved_step and not self._stopping:
                # The budget came down to this step after it was done: the job's last step
                # still ends in a checkpoint, as every finished job's does.
                await self._checkpoint()
            if self.checkpoints is not None:
                await asyncio.to_thread(self.checkpoints.wait)
            await self._close_ranks()
            await asyncio.sleep(0)  # let the last commit notices go out first
            # matplotlib takes seconds: never on the event loop, which carries the heartbeat.
            await asyncio.to_thread(self.run_logs.plot)
            await self._report({}, [], {}, finished=True)
            log.info("trainer.finished", job=self.job_id, step=self.step)
        except asyncio.CancelledError:
            raise
        except (Fenced, checkpoint.Superseded) as exc:
            # A newer trainer took over while this one was away (hung past its budget, or cut
            # off from etcd past its session): expected, and nothing to report (the leader has
            # recovered already), so a warning without a traceback (docs/decisions/0303). The
            # checkpoint folder can tell it first: its replacement claimed it at restore.
            log.warning("trainer.fenced_out", job=self.job_id, step=self.step, reason=str(exc))
            self.abandon_checkpoints()
            self.progress.enter(STOPPED_ON_ERROR)
        except Exception as exc:  # this trainer cannot go on: say why, then stop
            # The leader decides: recover on another trainer (a machine fault), or fail the job
            # when the same error came back after a replacement (coordinator/policy/verdicts.py).
            log.error("trainer.failed", job=self.job_id, step=self.step, exc_info=exc)
            self.progress.enter(STOPPED_ON_ERROR)
            if isinstance(exc, GroupBroken):
                await asyncio.sleep(GROUP_LOSS_GRACE_S)  # fenced meanwhile: cancelled here
            error, in_job = f"{type(exc).__name__}: {exc}", isinstance(exc, JOB_ERRORS)
            await report_until_heard(
                lambda: self._report({}, [], {}, error=error, error_in_job=in_job)
            )

    async def _start_ranks(self) -> None:
        assert self.trainer is not None and self.compute is not None
        assert self.transport is not None
        shares = (
            share_settings(self.spec, self.transport, self.compute.device) if self.sharded else None
        )
        self.group = HostedGroup(
            self.runtime,
            job_id=self.job_id,
            epoch=self.epoch,
            world_size=self.spec.trainer.world_size,
            compute=self.compute,
            sharded=self.sharded,
            shares=shares,
        )
        await self.group.start(
            self.trainer, check=self._check_starting, restore_from=self.restore_from, step=self.step
        )
        sharded = self.group.ranks.sharded
        if sharded is not None:
            # The whole model was sharded in place: from now on rank 0 holds its shards only.
            self.trainer, self.model = sharded, sharded.model

    def _check_starting(self) -> None:
        if self._stopping:
            raise RuntimeError("the trainer stopped while its ranks joined")

    async def _close_ranks(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await group.close()

    async def _follow(self) -> None:
        """Rank > 0 (`rank_group.follow_group`). A broken group leaves this rank stopped until
        the leader fences it (with the whole group)."""
        assert self.compute is not None
        try:
            await follow_group(
                self.runtime,
                job_id=self.job_id,
                epoch=self.epoch,
                rank=self.rank,
                spec=self.spec,
                compute=self.compute,
                model=self.model,
                tokenizer=self.tokenizer,
            )
        except asyncio.CancelledError:
            raise
        except Fenced as exc:
            log.warning("trainer.fenced_out", job=self.job_id, rank=self.rank, reason=str(exc))
            self.progress.enter(STOPPED_ON_ERROR)
        except Exception as exc:  # the group broke: the leader replaces it as a whole
            log.error("trainer.rank_failed", job=self.job_id, rank=self.rank, error=repr(exc))
            self.progress.enter(STOPPED_ON_ERROR)

    # ------------------------------------------------------------------ a step's parts

    def _inject(self, samples: list[grpo.Sample]) -> list[grpo.Sample]:
        """spec.faults: make this step's loss non-finite, as one corrupt sample would."""
        faults = self.spec.faults
        if self.step + 1 not in self.nan_steps or faults.nan_rank != 0 or not samples:
            return samples
        log.warning("trainer.fault_injected", job=self.job_id, step=self.step + 1, fault="nan")
        poisoned = dataclasses.replace(samples[0], advantage=float("nan"))
        return [poisoned, *samples[1:]]

    def _count_nonfinite(self, where: str) -> None:
        """Tell the monitor now, in this step, not at the next beat."""
        counters = self.progress.counters
        counters[f"nonfinite_{where}"] = counters.get(f"nonfinite_{where}", 0.0) + 1
        counters["step"] = float(self.step)
        log.error("trainer.nonfinite", job=self.job_id, step=self.step, where=where)
        self.progress.urge()

    async def _train(self, batch: list[Group]) -> dict[str, float]:
        assert self.trainer is not None
        if self.step + 1 in self.error_steps:
            log.warning(
                "trainer.fault_injected", job=self.job_id, step=self.step + 1, fault="error"
            )
            raise InjectedError(f"step {self.step + 1} failed (injected fault)")
        inputs = step_inputs(batch, self.step, scale_advantages=self.spec.trainer.scale_advantages)
        samples = self._inject(inputs.samples)
        self.progress.enter("forward_backward")
        result: grpo.StepMetrics | None = None
        if samples and self.group is not None:
            ranks = self.group.ranks
            result = await asyncio.to_thread(ranks.step, self.trainer, samples, step=self.step)
        elif samples:
            result = await asyncio.to_thread(self.trainer.step, samples)
        self.intake.mark_trained(batch)
        self.run_logs.audit(self.step, batch)
        self.step += 1
        if result is not None and result.nonfinite_where:
            # This rank's own finding; another rank's NaN is reported by that rank.
            self._count_nonfinite(result.nonfinite_where)
        self.acks.trained(batch)
        return step_metrics(batch, inputs, len(samples), result)

    async def _publish(self) -> None:
        assert self.transport is not None
        self.progress.enter("publish")
        transport = self.transport
        on_wait = lambda: self.progress.enter(WAITING_ETCD)  # noqa: E731
        share = self.group.ranks.share if self.group is not None else None
        if share is not None:
            await publish_share(
                transport, share, self.step, on_nonfinite=self._count_nonfinite, on_wait=on_wait
            )
        else:
            await publish_weights(
                transport,
                self.model,
                self.step,
                form=self.serving_form,
                on_nonfinite=self._count_nonfinite,
                on_wait=on_wait,
                unloadable=0 < self.spec.faults.unloadable_from_step <= self.step,
            )
        # The weight plane's counts (buckets served to rollouts so far), as of this publish.
        self.progress.counters.update(
            {**transport.gauges(), "step": self.step, "weight_version": self.step}
        )

    async def _checkpoint(self) -> None:
        assert self.checkpoints is not None and self.trainer is not None
        if self.step % self.spec.trainer.checkpoint_every and self.step != self.spec.trainer.steps:
            return
        self.progress.enter("checkpoint")
        self.acks.checkpointing(self.step)
        trainer, step = self.trainer, self.step
        self.saved_step = step
        extra = {"trained_groups": self.intake.trained_groups.to_json(), "job_id": self.job_id}
        if self.group is not None and self.sharded:
            # Every rank copies its shards off and writes them in the background.
            folder = checkpoint.new_tmp(self.run_dir / "checkpoints", step, self.epoch)
            written = await asyncio.to_thread(self.group.ranks.save, step, folder)
            self.checkpoints.save(
                checkpoint.ShardedSnapshot(
                    step, folder, written, checkpoint.capture_rng(), checkpoint.json_copy(extra)
                )
            )
            return

        def snapshot() -> checkpoint.Snapshot:
            return checkpoint.to_host(
                self.model, trainer.optimizer, step, checkpoint.capture_rng(), extra
            )

        # Only the snapshot blocks the step, and not the event loop (heartbeats, trajectory
        # streams); the write goes on in the writer thread.
        self.checkpoints.save(await asyncio.to_thread(snapshot))

    def _on_written(self, step: int, extra: dict[str, Any]) -> None:
        """Writer thread: the checkpoint of `step` is durable. Commit on the event loop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._commit_through, step)

    def _commit_through(self, step: int) -> None:
        """Everything trained up to `step` is in a durable checkpoint: rollouts may drop it."""
        self.durable_step = max(self.durable_step, step)
        self.acks.commit_through(step)
        log.info("trainer.committed", job=self.job_id, step=step)

    async def _evaluate(self) -> float:
        evaluation, tokenizer = self.evaluation, self.tokenizer
        assert evaluation is not None
        self.progress.enter("eval")
        if self.group is None or self.group.ranks.sharded is None:
            return await evaluation.run(self.model, tokenizer)
        completions = await asyncio.to_thread(
            self.group.ranks.evaluate,
            lambda model, agree: evaluation.generate(model, tokenizer, agree),
        )
        return evaluation.score(completions)

    async def _report(
        self,
        metrics: dict[str, float],
        trained: list[str],
        dropped: dict[str, str],
        *,
        finished: bool = False,
        error: str = "",
        error_in_job: bool = False,
    ) -> bool:
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        request = coordinator_pb2.ReportProgressRequest(
            job_id=self.job_id,
            instance_id=self.runtime.instance_id,
            epoch=self.epoch,
            step=self.step,
            weight_version=self.step,
            metrics=finite,
            trained_group_ids=trained,
            discarded_groups=dropped,
            finished=finished,
            error=error,
            error_in_job=error_in_job,
            regenerate_groups=self.intake.take_regenerate(),
            durable_step=self.durable_step,
            restored_step=self.restored_step,
        )
        reply = await report_to_coordinator(
            self.coordinator, request, on_wait=lambda: self.progress.enter(WAITING_COORDINATOR)
        )
        if reply.keep_going:
            self.adopt_steps(reply.steps)
        return reply.keep_going

    def adopt_steps(self, steps: int) -> None:
        """Train to `steps` from now on: the job's step budget as the leader answers it, which
        `robustrl update` may have changed since this trainer was bound (0: an older leader's
        answer, which says nothing). The leader never lowers it to a step this trainer has
        passed. The learning-rate schedule stays (`TrainerSpec.planned_steps`)."""
        if steps <= 0 or steps == self.spec.trainer.steps:
            return
        log.info("trainer.steps_changed", job=self.job_id, step=self.step, steps=steps)
        planned = self.spec.trainer.planned_steps
        trainer = self.spec.trainer.model_copy(update={"steps": steps, "lr_decay_steps": planned})
        self.spec = self.spec.model_copy(update={"trainer": trainer})

    # ------------------------------------------------------------------ chaos

    def inject_nan(self, step: int) -> None:
        """Chaos (Control INJECT_NAN): make `step`'s loss non-finite, as spec.faults would."""
        self.nan_steps.add(step)

    def inject_error(self, step: int) -> None:
        """Chaos (Control INJECT_ERROR): stop with an error at `step`, this trainer only."""
        self.error_steps.add(step)
