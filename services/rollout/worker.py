"""One job on a rollout: lease prompt groups, generate and score them, stream the
trajectories to the trainer, keep every trajectory until the trainer commits or rejects it.

Trajectory ids are `<group id>/<index>`: stable for a group whoever generates it, so a group
leased again after a failure de-duplicates at the trainer. Generation runs in a worker
thread; the event loop keeps the trajectory stream, heartbeats and weight pulls going.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from pathlib import Path

import grpc
import torch

from robustrl.v1 import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.aio import cancel_and_wait
from services.common.channels import open_channel
from services.common.coordinator_client import CoordinatorClient
from services.common.errors import InvalidArgument, Unavailable
from services.common.jobspec import JobSpec
from services.common.logs import get_logger
from services.common.runtime import ServiceRuntime
from services.common.ucx_transport import make_transport
from services.common.weights import WeightIntegrityError, WeightTransport, latest_announcement
from services.rollout.config import RolloutSettings
from services.rollout.engine import SamplingParams, TorchEngine
from services.rollout.rewards import RewardError, RewardFn, load_reward, score

log = get_logger(__name__)

RPC_DEADLINE = 10.0
RESEND_BATCH = 256
"""Trajectories per message when re-sending after a reconnect."""


class JobError(Exception):
    """This rollout cannot do the job's work; the coordinator fails the job with the message."""


class RolloutWorker:
    def __init__(
        self,
        runtime: ServiceRuntime,
        settings: RolloutSettings,
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
        self.engine: TorchEngine | None = None
        self.reward: RewardFn | None = None
        self.transport: WeightTransport | None = None
        # Trajectories the trainer has not committed or rejected yet, by id.
        self.unsettled: dict[str, trainer_pb2.Trajectory] = {}
        self.received: set[str] = set()
        self.acked = asyncio.Event()
        self.outbox: asyncio.Queue[list[trainer_pb2.Trajectory]] = asyncio.Queue()
        self.tokens_generated = 0
        self.loaded_epoch = 0  # trainer epoch of the weights in the engine (0: from disk)
        self._tasks: list[asyncio.Task[None]] = []

    def load(self) -> None:
        torch.set_num_threads(self.settings.torch_threads)
        path = Path(self.spec.model.path)
        if not (path / "config.json").exists():
            raise InvalidArgument(
                f"model.path: no model at {path} (run `robustrl model init` to create the tiny one)"
            )
        try:
            self.reward = load_reward(self.spec.task.reward)
        except RewardError as exc:
            raise InvalidArgument(f"task.reward: {exc}") from exc
        self.engine = TorchEngine.from_pretrained(str(path))

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._generate_loop(), name=f"generate-{self.job_id}"),
            asyncio.create_task(self._stream_loop(), name=f"stream-{self.job_id}"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self.transport is not None:
            await self.transport.close()

    @property
    def coordinator(self) -> CoordinatorClient:
        assert self.runtime.client is not None
        return CoordinatorClient(self.runtime.client, self.runtime.keys)

    # ------------------------------------------------------------------ generation

    async def _generate_loop(self) -> None:
        progress = self.runtime.progress
        assert self.runtime.client is not None
        # Pulled versions are kept and served to peers (relay), so a new or recovered rollout
        # does not have to go to the trainer for them.
        self.transport = await make_transport(
            self.spec.trainer.weight_transport,
            self.runtime.client,
            self.runtime.keys,
            self.job_id,
            instance_id=self.runtime.instance_id,
            host=self.runtime.settings.resolved_advertise_host(),
            session_ttl=self.runtime.etcd_settings.session_ttl,
            keep_versions=1,  # at most the held version plus the one being pulled
        )
        while True:
            request = coordinator_pb2.LeaseWorkRequest(
                job_id=self.job_id,
                instance_id=self.runtime.instance_id,
                epoch=self.epoch,
                max_groups=self.settings.groups_per_lease,
            )
            try:
                reply = await self._lease(request)
            except (grpc.aio.AioRpcError, Unavailable) as exc:
                log.info("rollout.lease_failed", error=str(exc)[:200])
                await asyncio.sleep(0.5)
                continue
            if reply.job_done:
                progress.phase = "idle"
                return
            if not reply.groups:
                progress.phase = "waiting"
                await asyncio.sleep(max(reply.retry_after_s, 0.05))
                continue
            try:
                await self._ensure_weights(reply.min_weight_version)
                progress.phase = "generating"
                progress.counters["requests_in_flight"] = float(len(reply.groups))
                trajectories = await self._generate(list(reply.groups))
            except JobError as exc:
                log.error("rollout.job_error", job=self.job_id, error=str(exc))
                await self._complete([], error=str(exc))
                return
            finally:
                progress.counters["requests_in_flight"] = 0.0
            for traj in trajectories:
                self.unsettled[traj.trajectory_id] = traj
            self.outbox.put_nowait(trajectories)
            progress.phase = "delivering"
            await self._wait_received([t.trajectory_id for t in trajectories])
            await self._complete([g.group_id for g in reply.groups])

    async def _lease(
        self, request: coordinator_pb2.LeaseWorkRequest
    ) -> coordinator_pb2.LeaseWorkResponse:
        return await self.coordinator.write(lambda s: s.LeaseWork(request, timeout=RPC_DEADLINE))

    async def _generate(
        self, groups: list[coordinator_pb2.PromptGroup]
    ) -> list[trainer_pb2.Trajectory]:
        assert self.engine is not None and self.reward is not None
        spec = self.spec
        version = self.engine.weight_version
        params = SamplingParams(
            n=groups[0].group_size,
            temperature=spec.rollout.temperature,
            max_new_tokens=spec.rollout.max_new_tokens,
            seed=zlib.crc32(f"{spec.seed}/{groups[0].group_id}/{version}".encode()),
        )
        started = time.monotonic()
        try:
            outputs = await asyncio.to_thread(
                self.engine.generate, [g.prompt for g in groups], params
            )
        except ValueError as exc:  # e.g. a prompt longer than the context
            raise JobError(f"cannot generate: {exc}") from exc
        out: list[trainer_pb2.Trajectory] = []
        tokens = 0
        for group, completions in zip(groups, outputs, strict=True):
            for index, completion in enumerate(completions):
                try:
                    reward = score(self.reward, group.prompt, completion.text, group.answer)
                except RewardError as exc:
                    raise JobError(str(exc)) from exc
                tokens += len(completion.token_ids)
                out.append(
                    trainer_pb2.Trajectory(
                        trajectory_id=f"{group.group_id}/{index}",
                        job_id=self.job_id,
                        rollout_instance_id=self.runtime.instance_id,
                        rollout_epoch=self.epoch,
                        group_id=group.group_id,
                        group_size=group.group_size,
                        weight_version=version,
                        prompt_ids=completion.prompt_ids,
                        completion_ids=completion.token_ids,
                        logprobs=completion.logprobs,
                        reward=reward,
                        finish_reason=completion.finish_reason,
                    )
                )
        self.tokens_generated += tokens
        counters = self.runtime.progress.counters
        counters["tokens_generated"] = float(self.tokens_generated)
        counters["tokens_per_s"] = tokens / max(time.monotonic() - started, 1e-6)
        counters["weight_version"] = float(version)
        return out

    async def _ensure_weights(self, min_version: int) -> None:
        """Load the newest announced version; wait for one >= min_version if needed."""
        assert self.engine is not None and self.runtime.client is not None
        while True:
            latest = await latest_announcement(self.runtime.client, self.runtime.keys, self.job_id)
            if latest is not None and (
                latest.trainer_epoch > self.loaded_epoch
                or latest.version > self.engine.weight_version
            ):
                # A newer trainer epoch wins even with a lower version: a restored trainer
                # goes back to its checkpoint's step.
                assert self.transport is not None
                try:
                    tensors = await self.transport.fetch(latest)
                except (WeightIntegrityError, grpc.aio.AioRpcError) as exc:
                    log.warning(
                        "rollout.weights_pull_failed", version=latest.version, error=str(exc)[:200]
                    )
                    await asyncio.sleep(0.2)
                    continue
                # Swapped between generation batches: no batch ever mixes two versions.
                self.engine.load_weights(tensors, version=latest.version)
                self.loaded_epoch = latest.trainer_epoch
                log.info("rollout.weights_loaded", job=self.job_id, version=latest.version)
            if self.engine.weight_version >= min_version:
                return
            await asyncio.sleep(0.1)

    async def _wait_received(self, ids: list[str]) -> None:
        """Until the trainer has acknowledged (or settled) every one of ids."""
        while not all(i in self.received or i not in self.unsettled for i in ids):
            self.acked.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.acked.wait(), 1.0)

    async def _complete(self, group_ids: list[str], error: str = "") -> None:
        request = coordinator_pb2.CompleteWorkRequest(
            job_id=self.job_id,
            instance_id=self.runtime.instance_id,
            epoch=self.epoch,
            group_ids=group_ids,
            error=error,
        )
        for attempt in range(20):  # rides out a coordinator failover (new leader elsewhere)
            try:
                await self.coordinator.write(
                    lambda s: s.CompleteWork(request, timeout=RPC_DEADLINE)
                )
                return
            except (grpc.aio.AioRpcError, Unavailable) as exc:
                log.info("rollout.complete_failed", attempt=attempt, error=str(exc)[:200])
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ the stream

    async def _stream_loop(self) -> None:
        assert self.runtime.registry is not None
        while True:
            trainers, _ = await self.runtime.registry.list("trainer")
            bound = [t for t in trainers if t.job_id == self.job_id]
            if not bound:
                await asyncio.sleep(0.5)
                continue
            try:
                await self._stream_to(bound[0].address)
            except grpc.aio.AioRpcError as exc:
                log.info("rollout.stream_broken", code=exc.code().name, details=exc.details())
            self.received.clear()
            await asyncio.sleep(0.5)

    async def _stream_to(self, address: str) -> None:
        async with open_channel(address) as channel:
            call = trainer_pb2_grpc.TrainerStub(channel).PushTrajectories()
            writer = asyncio.create_task(self._write(call))
            try:
                async for ack in call:
                    self.received.update(ack.received_ids)
                    for tid in [*ack.committed_ids, *ack.rejected]:
                        self.unsettled.pop(tid, None)
                        self.received.discard(tid)
                    self.acked.set()
                    self.runtime.progress.counters["unsettled"] = float(len(self.unsettled))
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await writer

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        # A new stream (the first, or after the trainer restarted): everything not yet
        # committed goes again, and the trainer de-duplicates by id. What is queued is
        # already in `unsettled`, so it goes out with the re-send.
        while not self.outbox.empty():
            self.outbox.get_nowait()
        pending = list(self.unsettled.values())
        for start in range(0, len(pending), RESEND_BATCH):
            await call.write(
                trainer_pb2.TrajectoryBatch(trajectories=pending[start : start + RESEND_BATCH])
            )
        while True:
            batch = [t for t in await self.outbox.get() if t.trajectory_id in self.unsettled]
            if batch:
                await call.write(trainer_pb2.TrajectoryBatch(trajectories=batch))
