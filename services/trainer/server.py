"""The Trainer gRPC service: control (bind/release/fence), the trajectory stream, weight pulls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from robustrl.contracts.errors import FailedPrecondition
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.config import EtcdSettings
from robustrl.core.logs import get_logger
from robustrl.core.role_server import RoleControl
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import trainer_pb2, trainer_pb2_grpc
from robustrl.weights import GrpcStreamTransport
from services.trainer.config import TrainerSettings
from services.trainer.worker import TrainerWorker

log = get_logger(__name__)

StreamItem = trainer_pb2.TrajectoryAck | FailedPrecondition | None
"""What a trajectory stream's outbox carries: an ack, the error that ends the stream, or None
(the rollout closed its side)."""

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerServicer(RoleControl, trainer_pb2_grpc.TrainerServicer):
    def __init__(self, runtime: ServiceRuntime, settings: TrainerSettings) -> None:
        def make_worker(job_id: str, epoch: int, spec: JobSpec) -> TrainerWorker:
            return TrainerWorker(runtime, settings, job_id=job_id, epoch=epoch, spec=spec)

        super().__init__(runtime, make_worker)
        self._streams: set[asyncio.Queue[StreamItem]] = set()
        """The outboxes of the open trajectory streams."""

    async def stop_worker(self) -> None:
        """End every open trajectory stream first. A rollout re-sends what is not committed
        only on a new stream: an open one to a trainer that was fenced while it lives (its step
        loop stopped on an error, or hung) would otherwise hold the rollout's trajectories
        until it writes again, and a rollout at its staleness bound never writes again."""
        job = self.worker.job_id if self.worker is not None else self.binding.job_id
        if self.binding.fenced and isinstance(self.worker, TrainerWorker):
            # Its replacement owns the job's checkpoints now: write nothing more there.
            self.worker.abandon_checkpoints()
        for outbox in self._streams:
            outbox.put_nowait(FailedPrecondition(f"this trainer no longer works on job {job}"))
        await super().stop_worker()

    def _worker_for(self, job_id: str) -> TrainerWorker:
        if self.binding.fenced:
            raise FailedPrecondition("this trainer was fenced; it accepts nothing")
        if not isinstance(self.worker, TrainerWorker) or self.worker.job_id != job_id:
            bound = self.worker.job_id if self.worker else "no job"
            raise FailedPrecondition(f"this trainer runs {bound}, not job {job_id}")
        return self.worker

    async def PushTrajectories(
        self,
        request_iterator: AsyncIterator[trainer_pb2.TrajectoryBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_pb2.TrajectoryAck]:
        """Acks for each trajectory as it arrives, and commit/reject notices as they happen."""
        outbox: asyncio.Queue[StreamItem] = asyncio.Queue()
        subscribed: tuple[TrainerWorker, str, asyncio.Queue[trainer_pb2.TrajectoryAck]] | None = (
            None
        )
        forwarder: asyncio.Task[None] | None = None

        async def pump() -> None:
            nonlocal subscribed, forwarder
            try:
                async for batch in request_iterator:
                    ack = trainer_pb2.TrajectoryAck()
                    for trajectory in batch.trajectories:
                        worker = self._worker_for(trajectory.job_id)
                        if subscribed is None:
                            queue = worker.acks.subscribe(trajectory.rollout_instance_id)
                            subscribed = (worker, trajectory.rollout_instance_id, queue)
                            forwarder = asyncio.create_task(_forward(queue, outbox))
                        verdict, reason = worker.offer(trajectory)
                        if verdict == "received":
                            ack.received_ids.append(trajectory.trajectory_id)
                        elif verdict == "committed":
                            ack.committed_ids.append(trajectory.trajectory_id)
                        else:
                            ack.rejected[trajectory.trajectory_id] = reason
                    outbox.put_nowait(ack)
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(pump())
        self._streams.add(outbox)
        try:
            while (ack := await outbox.get()) is not None:
                if isinstance(ack, FailedPrecondition):
                    raise ack  # the worker stopped (stop_worker)
                yield ack
            reader.result()  # re-raise what ended the stream (e.g. FailedPrecondition)
        finally:
            self._streams.discard(outbox)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if forwarder is not None:
                forwarder.cancel()
            if subscribed is not None:
                worker, rollout, queue = subscribed
                worker.acks.unsubscribe(rollout, queue)

    async def PullWeights(
        self, request: trainer_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.WeightChunk]:
        worker = self._worker_for(request.job_id)
        if not isinstance(worker.transport, GrpcStreamTransport):
            raise FailedPrecondition("this trainer does not serve weights over gRPC")
        async for chunk in worker.transport.serve(request):
            yield chunk


async def _forward(
    source: asyncio.Queue[trainer_pb2.TrajectoryAck], sink: asyncio.Queue[StreamItem]
) -> None:
    while True:
        sink.put_nowait(await source.get())


async def serve(settings: TrainerSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime(
        "trainer",
        settings,
        etcd,
        service_names=[SERVICE_NAME],
        labels=settings.labels(),
    )
    servicer = TrainerServicer(runtime, settings)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, runtime.host.server)
    await runtime.start(on_fenced=servicer.fenced)
    runtime.host.before_stop.insert(0, servicer.stop_worker)
    return runtime
