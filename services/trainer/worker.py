"""One job on a trainer: load the model, take trajectories in, run GRPO steps, checkpoint,
publish weight versions, evaluate, and report progress to the coordinator.

The step loop runs torch in a worker thread so the event loop keeps serving trajectory
streams, weight pulls and heartbeats while a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.contracts.errors import Fenced, InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.aio import cancel_and_wait
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.etcd_client import until_etcd_answers
from robustrl.core.fences import FenceSet
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime, long_lived_objects
from robustrl.generation.engine import ContextExceeded, SamplingParams, TorchEngine
from robustrl.generation.rewards import RewardError, RewardFn, load_reward, score
from robustrl.generation.tasks import TaskItem, UnknownTaskError, get_task
from robustrl.v1 import coordinator_pb2, trainer_pb2
from robustrl.weights import WeightTransport, make_transport, warm_up_ucxx
from services.trainer import checkpoint, grpo
from services.trainer.config import TrainerSettings
from services.trainer.intake import Group, Intake, TrainedGroups
from services.trainer.ranks import LeaderRanks
from services.trainer.report import write_reward_plot

log = get_logger(__name__)

REPORT_DEADLINE = 10.0

# Trainer phases while it waits on something outside it: no phase budget applies (a hang
# budget would replace a healthy trainer for an etcd or coordinator outage).
WAITING_ETCD = "waiting_etcd"
WAITING_COORDINATOR = "waiting_coordinator"
STOPPED_ON_ERROR = "stopped_on_error"
"""Phase of a trainer whose step loop ended on an error: it waits to be fenced and replaced."""
FINAL_REPORT_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    }
)
"""Answers to a report that sending it again cannot change."""


class NonFiniteWeights(RuntimeError):
    """The weights about to be published contain NaN/Inf."""


class InjectedError(RuntimeError):
    """A step made to fail by spec.faults.error_steps or chaos (INJECT_ERROR)."""


JOB_ERRORS = (RewardError, InvalidArgument, UnknownTaskError, ContextExceeded)
"""Errors in the job itself (its reward plug-in, its spec, its prompts): another trainer would
stop the same way, so the job fails at once. Any other error is taken as this trainer's
machine failing, and recovered on another trainer (coordinator/recovery.py)."""


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
        self.run_dir = Path(settings.runs_dir) / job_id
        self.intake = Intake(job_id, spec.trainer.max_staleness)
        self.step = 0
        self.durable_step = 0
        """Steps [0, durable_step) are in a durable checkpoint (written, or restored from)."""
        self.restored_step = 0
        """The step of the checkpoint this trainer restored (0: it started afresh)."""
        self.nan_steps: set[int] = set(spec.faults.nan_loss_steps)
        self.error_steps: set[int] = set(spec.faults.error_steps)
        self.data_arrived = asyncio.Event()
        self.outboxes: dict[str, list[asyncio.Queue[trainer_pb2.TrajectoryAck]]] = defaultdict(list)
        self.uncommitted: dict[str, list[str]] = defaultdict(list)
        self.transport: WeightTransport | None = None
        self.ranks: LeaderRanks | None = None
        """Ranks 1..N-1 (spec.trainer.world_size > 1); this process is rank 0."""
        self.fences: FenceSet | None = None
        assert runtime.client is not None
        self.coordinator = CoordinatorClient(runtime.client, runtime.keys)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Filled by load():
        self.model: Any = None
        self.tokenizer: Any = None
        self.trainer: grpo.GRPOTrainer | None = None
        self.reward: RewardFn | None = None
        self.eval_items: list[TaskItem] = []
        self.checkpoints: checkpoint.CheckpointWriter | None = None
        # Trained trajectory ids per step, by rollout, until that step's checkpoint is durable.
        self.pending_commits: dict[int, dict[str, list[str]]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

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
        path = Path(spec.model.path)
        if not (path / "config.json").exists():
            raise InvalidArgument(
                f"model.path: no model at {path} (run `robustrl model init` to create the tiny one)"
            )
        try:
            task = get_task(spec.task.name)
        except UnknownTaskError as exc:
            raise InvalidArgument(f"task.name: {exc}") from exc
        try:
            self.eval_items = task.eval_split(spec.task.eval_size)
        except ValueError as exc:
            raise InvalidArgument(f"task.eval_size: {exc}") from exc
        try:
            self.reward = load_reward(spec.task.reward)
        except RewardError as exc:
            raise InvalidArgument(f"task.reward: {exc}") from exc
        torch.manual_seed(spec.seed)
        with long_lived_objects():
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.trainer = grpo.GRPOTrainer(
            self.model, grpo.grpo_config(spec), pad_id=int(self.tokenizer.pad_token_id)
        )
        if spec.trainer.weight_transport == "ucx":
            warm_up_ucxx()

    def load(self) -> None:
        """Everything the job needs: `prepare` (if not done ahead), the checkpoint writer and
        the restore from the job's latest checkpoint, read now. The writer is not made ahead:
        it claims the folder for this trainer's epoch (a fenced trainer's writer publishes
        nothing after that) and clears the unfinished writes it finds, and a standby's must
        not do either while the trainer it stands by for still runs."""
        self.prepare()
        assert self.trainer is not None
        if self.epoch == FIRST_EPOCH:
            self._set_aside_earlier_run()
        self.checkpoints = checkpoint.CheckpointWriter(
            self.run_dir / "checkpoints",
            keep=self.settings.keep_checkpoints,
            on_written=self._on_written,
            epoch=self.epoch,
        )
        restored = checkpoint.load_latest(self.run_dir / "checkpoints")
        if restored is not None:
            self.step = checkpoint.restore(restored, self.model, self.trainer.optimizer)
            self.durable_step = self.restored_step = self.step
            self.intake.trained_groups = TrainedGroups.from_json(
                restored.extra.get("trained_groups", [])
            )
            self.intake.restored_step = self.step
            self._forget_after(self.step)
            log.info("trainer.restored", job=self.job_id, step=self.step, epoch=self.epoch)
        else:
            # An earlier trainer of this job died before its first checkpoint: its steps are
            # trained again from step 0, and the evaluation before training is made again. (A
            # first trainer's folder was set aside: it has no logs to forget.)
            self._forget_after(None)

    def _set_aside_earlier_run(self) -> None:
        """A job's first trainer (FIRST_EPOCH) has nothing to restore: a run folder it finds
        is an earlier job's that had the same id (deleted, then submitted again). Restoring
        its checkpoint put the new job at the old one's step, and that job then trained
        nothing. The folder is renamed, not removed: its checkpoints and logs are kept."""
        if not self.run_dir.exists() or not any(self.run_dir.iterdir()):
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.run_dir.with_name(f"{self.run_dir.name}.earlier-{stamp}")
        n = 0
        while aside.exists():
            n += 1
            aside = self.run_dir.with_name(f"{self.run_dir.name}.earlier-{stamp}-{n}")
        self.run_dir.rename(aside)
        log.warning("trainer.earlier_run_set_aside", job=self.job_id, moved_to=str(aside))

    def _forget_after(self, step: int | None) -> None:
        """The run's logs keep only what the restored state contains: steps after the
        checkpoint were lost with the failed trainer and are trained again. None: nothing was
        restored, and the logs keep nothing."""
        # trained.jsonl numbers a step by the count before it (0 is the first step);
        # metrics.jsonl by the count after it (step 0 is the evaluation before training).
        last_kept = {"trained.jsonl": -1, "metrics.jsonl": -1}
        if step is not None:
            last_kept = {"trained.jsonl": step - 1, "metrics.jsonl": step}
        for name, last in last_kept.items():
            path = self.run_dir / name
            if not path.exists():
                continue
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line).get("step", 0) <= last
            ]
            # A new file in its place, not a truncation: a fenced trainer that opened the old
            # one before it was frozen writes into that one when it resumes (`_append`).
            checkpoint.replace_text(path, "".join(line + "\n" for line in kept))

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"train-{self.job_id}")

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

    def subscribe(self, rollout: str) -> asyncio.Queue[trainer_pb2.TrajectoryAck]:
        queue: asyncio.Queue[trainer_pb2.TrajectoryAck] = asyncio.Queue()
        self.outboxes[rollout].append(queue)
        return queue

    def unsubscribe(self, rollout: str, queue: asyncio.Queue[trainer_pb2.TrajectoryAck]) -> None:
        with contextlib.suppress(ValueError):
            self.outboxes[rollout].remove(queue)

    def _tell(self, rollout: str, ack: trainer_pb2.TrajectoryAck) -> None:
        for queue in self.outboxes.get(rollout, []):
            queue.put_nowait(ack)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        spec = self.spec
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            assert self.runtime.client is not None
            self.fences = FenceSet(self.runtime.client, self.runtime.keys)
            self.fences.start()
            client = self.runtime.client
            self.transport = await until_etcd_answers(
                lambda: make_transport(
                    spec.trainer.weight_transport,
                    client,
                    self.runtime.keys,
                    self.job_id,
                    instance_id=self.runtime.instance_id,
                    epoch=self.epoch,
                    grpc_address=self.runtime.address,
                    host=self.runtime.settings.resolved_advertise_host(),
                    session_ttl=self.runtime.etcd_settings.session_ttl,
                    bucket_bytes=spec.trainer.weight_bucket_mib << 20,
                    checksum_algorithm=(
                        None
                        if spec.trainer.weight_checksum == "auto"
                        else spec.trainer.weight_checksum
                    ),
                ),
                "starting the weight transport",
            )
            log.info("trainer.weights_transport", kind=self.transport.name)
            if spec.trainer.world_size > 1:
                await self._start_ranks()
            await self._publish()
            if self.step == 0:
                await self._record(self.step, {"eval_reward": await self._evaluate()})
            last = time.monotonic()
            # ETTR: a kept step stands for the time since the previous one ended (or since this
            # trainer became ready), within a bound on the wait for data (coordinator/ettr.py);
            # the time before a restored trainer was ready is not part of it.
            previous_end = time.time()
            while self.step < spec.trainer.steps and not self._stopping:
                batch, stale = self.intake.take_batch(self.step, spec.trainer.groups_per_step)
                dropped = self._reject(stale)
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
                await self._publish()
                await self._checkpoint()
                if self.step % spec.trainer.eval_every == 0 or self.step == spec.trainer.steps:
                    metrics["eval_reward"] = await self._evaluate()
                metrics["step_started_at"] = previous_end
                metrics["step_work_started_at"] = work_started
                metrics["step_ended_at"] = previous_end = time.time()
                await self._record(self.step, metrics)
                keep_going = await self._report(metrics, [g.group_id for g in batch], dropped)
                if not keep_going:
                    return
            if self.checkpoints is not None:
                await asyncio.to_thread(self.checkpoints.wait)
            await self._close_ranks()
            await asyncio.sleep(0)  # let the last commit notices go out first
            # matplotlib takes seconds: never on the event loop, which carries the heartbeat.
            await asyncio.to_thread(
                write_reward_plot, self.run_dir / "metrics.jsonl", self.run_dir / "reward.png"
            )
            await self._report({}, [], {}, finished=True)
            log.info("trainer.finished", job=self.job_id, step=self.step)
        except asyncio.CancelledError:
            raise
        except (Fenced, checkpoint.Superseded) as exc:
            # A newer trainer took over while this one was away (hung past its budget, or cut
            # off from etcd past its session): expected, and nothing to report (the leader has
            # recovered already). It used to be logged as a failure, with a traceback. The
            # checkpoint folder can tell it first: its replacement claimed it at restore.
            log.warning("trainer.fenced_out", job=self.job_id, step=self.step, reason=str(exc))
            self.abandon_checkpoints()
            self.progress.enter(STOPPED_ON_ERROR)
        except Exception as exc:  # this trainer cannot go on: say why, then stop
            # The leader decides: recover on another trainer (a machine fault), or fail the job
            # when the same error came back after a replacement (coordinator/recovery.py).
            log.error("trainer.failed", job=self.job_id, step=self.step, exc_info=exc)
            self.progress.enter(STOPPED_ON_ERROR)
            error, in_job = f"{type(exc).__name__}: {exc}", isinstance(exc, JOB_ERRORS)
            await report_until_heard(
                lambda: self._report({}, [], {}, error=error, error_in_job=in_job)
            )

    async def _start_ranks(self) -> None:
        """Start ranks 1..N-1 on this host and give them this rank's (maybe restored) state."""
        assert self.trainer is not None
        spec_path = self.run_dir / "spec.json"
        spec_path.write_text(self.spec.model_dump_json())
        self.ranks = LeaderRanks(self.progress)
        await asyncio.to_thread(
            self.ranks.start,
            self.trainer,
            spec_path=spec_path,
            job_id=self.job_id,
            world_size=self.spec.trainer.world_size,
            etcd=self.runtime.etcd_settings,
            instance_id=self.runtime.instance_id,
            settings=self.runtime.settings,
            torch_threads=self.settings.torch_threads,
        )
        log.info("trainer.ranks_started", job=self.job_id, world_size=self.spec.trainer.world_size)

    async def _close_ranks(self) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            await asyncio.to_thread(ranks.close)

    def _reject(self, stale: list[tuple[Group, str]]) -> dict[str, str]:
        """Tell each rollout which of its trajectories were dropped, so it stops keeping them."""
        for group, why in stale:
            log.info("trainer.group_dropped", job=self.job_id, group=group.group_id, reason=why)
            for traj in group.trajectories.values():
                ack = trainer_pb2.TrajectoryAck()
                ack.rejected[traj.trajectory_id] = why
                self._tell(traj.rollout_instance_id, ack)
        return {group.group_id: why for group, why in stale}

    @property
    def progress(self) -> Progress:
        return self.runtime.progress

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
        samples: list[grpo.Sample] = []
        rewards: list[float] = []
        staleness: list[int] = []
        for group in batch:
            trajectories = sorted(group.trajectories.values(), key=lambda t: t.trajectory_id)
            group_rewards = [t.reward for t in trajectories]
            rewards += group_rewards
            for traj, adv in zip(trajectories, grpo.group_advantages(group_rewards), strict=True):
                staleness.append(self.step - traj.weight_version)
                if adv == 0.0:
                    # No gradient; leaving it out keeps the per-token normalisation about the
                    # samples that carry signal.
                    continue
                samples.append(
                    grpo.Sample(
                        prompt_ids=list(traj.prompt_ids),
                        completion_ids=list(traj.completion_ids),
                        behaviour_logprobs=list(traj.logprobs),
                        advantage=adv,
                    )
                )
        samples = self._inject(samples)
        self.progress.enter("forward_backward")
        result: grpo.StepMetrics | None = None
        if samples and self.ranks is not None:
            result = await asyncio.to_thread(
                self.ranks.step, self.trainer, samples, step=self.step + 1
            )
        elif samples:
            result = await asyncio.to_thread(self.trainer.step, samples)
        self.intake.mark_trained(batch)
        self._audit(batch)
        self.step += 1
        if result is not None and result.nonfinite_where:
            # This rank's own finding; another rank's NaN is reported by that rank.
            self._count_nonfinite(result.nonfinite_where)
        for group in batch:
            for traj in group.trajectories.values():
                self.uncommitted[traj.rollout_instance_id].append(traj.trajectory_id)
        tokens = float(sum(len(t.completion_ids) for g in batch for t in g.trajectories.values()))
        metrics = {
            "reward": sum(rewards) / len(rewards),
            "tokens": tokens,
            "samples": float(len(samples)),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
        }
        if result is not None:  # None: every group was all-right or all-wrong, nothing to learn
            metrics |= {
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "clip_frac": result.clip_frac,
                "kl": result.kl,
                "lr": result.lr,
                "nonfinite": float(result.nonfinite),
            }
        return metrics

    def _audit(self, batch: list[Group]) -> None:
        """trained.jsonl: which trajectories (and weight versions) each step trained on."""
        line = {
            "step": self.step,
            "groups": {
                g.group_id: {
                    "ids": sorted(g.trajectories),
                    "versions": [g.trajectories[t].weight_version for t in sorted(g.trajectories)],
                }
                for g in batch
            },
        }
        self._append("trained.jsonl", line)

    def _append(self, name: str, line: dict[str, Any]) -> None:
        """One line to a run log, while this trainer still owns the run: a replacement
        truncated the logs to the step it restored (`_forget_after`), and a fenced trainer
        that had not heard of it yet appended a step the job never kept.

        The file is opened before the claim is read. A replacement claims the folder before
        it replaces the logs, so a trainer frozen anywhere in here (SIGSTOP) and resumed after
        its replacement either reads the claim or writes into the file the replacement has
        already replaced, which nothing reads again. Checked first and opened after, a
        trainer frozen in between appended its step to the replacement's log on resuming (a
        chaos test's trained.jsonl read steps 29, 31, 30, 31)."""
        with (self.run_dir / name).open("a") as out:
            if self.checkpoints is not None:
                self.checkpoints.ensure_owner()
            out.write(json.dumps(line) + "\n")

    async def _publish(self) -> None:
        assert self.transport is not None
        self.progress.enter("publish")
        # No copy here: the transport copies before publish returns, and the model does not
        # change while this step awaits it.
        tensors = [(name, t.detach()) for name, t in self.model.state_dict().items()]

        def nonfinite() -> list[str]:
            return [name for name, t in tensors if not bool(torch.isfinite(t).all())]

        bad = await asyncio.to_thread(nonfinite)
        if bad:
            # Rollouts must never load these; the monitor reports it, recovery rolls back.
            self._count_nonfinite("weights")
            raise NonFiniteWeights(f"non-finite values in {', '.join(bad[:3])} at step {self.step}")
        # Publishing again after a failure is safe: the same epoch rewrites the same manifest.
        transport, step = self.transport, self.step
        await until_etcd_answers(
            lambda: transport.publish(step, tensors),
            "publishing weights",
            on_wait=lambda: self.progress.enter(WAITING_ETCD),
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
        self.pending_commits[self.step] = dict(self.uncommitted)
        self.uncommitted.clear()
        trainer, step = self.trainer, self.step

        def snapshot() -> checkpoint.Snapshot:
            extra = {
                "trained_groups": self.intake.trained_groups.to_json(),
                "job_id": self.job_id,
            }
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
        for done in sorted(s for s in self.pending_commits if s <= step):
            for rollout, ids in self.pending_commits.pop(done).items():
                self._tell(rollout, trainer_pb2.TrajectoryAck(committed_ids=ids))
        log.info("trainer.committed", job=self.job_id, step=step)

    async def _evaluate(self) -> float:
        assert self.reward is not None
        self.progress.enter("eval")
        engine = TorchEngine(self.model, self.tokenizer)
        prompts = [item.prompt for item in self.eval_items]
        params = SamplingParams(
            n=1,
            temperature=0.0,
            max_new_tokens=self.spec.rollout.max_new_tokens,
            seed=self.spec.seed,
        )
        outputs = await asyncio.to_thread(engine.generate, prompts, params)
        total = 0.0
        for item, completions in zip(self.eval_items, outputs, strict=True):
            total += score(self.reward, item.prompt, completions[0].text, item.answer)
        return total / max(1, len(self.eval_items))

    async def _record(self, step: int, metrics: dict[str, float]) -> None:
        self._append(
            "metrics.jsonl", {"step": step, "version": step, "time": time.time(), **metrics}
        )

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
        return await report_to_coordinator(
            self.coordinator, request, on_wait=lambda: self.progress.enter(WAITING_COORDINATOR)
        )

    def inject_nan(self, step: int) -> None:
        """Chaos (Control INJECT_NAN): make `step`'s loss non-finite, as spec.faults would."""
        self.nan_steps.add(step)

    def inject_error(self, step: int) -> None:
        """Chaos (Control INJECT_ERROR): stop with an error at `step`, this trainer only."""
        self.error_steps.add(step)


async def report_until_heard(
    send: Callable[[], Awaitable[object]], first_delay: float = 0.5, max_delay: float = 10.0
) -> bool:
    """Send a stopped trainer's error report until the leader has heard it (True), or has
    answered that it never will (False: FINAL_REPORT_CODES, as when the trainer was fenced).
    A stopped trainer has no hang budget, so a report lost on the way left its job waiting for
    ever; that was seen when etcd was out of space and the leader answered UNKNOWN. Any other
    failure is logged and the report sent again, `first_delay` doubling up to `max_delay`."""
    delay = first_delay
    while True:
        try:
            await send()
            return True
        except grpc.aio.AioRpcError as refused:
            if refused.code() in FINAL_REPORT_CODES:
                log.warning("trainer.error_not_reported", reason=refused.details())
                return False
            failure = f"{refused.code().name}: {refused.details()}"
        except Exception as other:  # anything else: say so and try again
            failure = repr(other)
        log.warning("trainer.error_report_failed", error=failure[:200], retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


async def report_to_coordinator(
    client: CoordinatorClient,
    request: coordinator_pb2.ReportProgressRequest,
    on_wait: Callable[[], None] | None = None,
) -> bool:
    """ReportProgress to the leader, for as long as no leader answers
    (`CoordinatorClient.write_until_answered`). Training cannot go on without its reports:
    the coordinator decides whether the job goes on. A report sent again is safe: the
    coordinator ignores the groups it settled already."""
    reply = await client.write_until_answered(
        lambda s: s.ReportProgress(request, timeout=REPORT_DEADLINE),
        on_wait=on_wait,
        doing="reporting progress",
        step=request.step,
    )
    return bool(reply.keep_going)
