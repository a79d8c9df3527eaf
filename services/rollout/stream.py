"""A rollout's trajectory stream to its job's trainer: every trajectory is kept until the
trainer commits or rejects it, and a new stream (the first, or after the trainer restarted or
was replaced) sends again everything not yet settled; the trainer de-duplicates by id."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from robustrl.core.channels import open_channel
from robustrl.core.etcd_client import until_etcd_answers
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import trainer_pb2, trainer_pb2_grpc

log = get_logger(__name__)

RESEND_BATCH = 256
"""Trajectories per message when re-sending after a reconnect."""


class TrajectoryStream:
    def __init__(self, runtime: ServiceRuntime, job_id: str) -> None:
        self.runtime = runtime
        self.job_id = job_id
        self.unsettled: dict[str, trainer_pb2.Trajectory] = {}
        """Trajectories the trainer has not committed or rejected yet, by id."""
        self.received: set[str] = set()
        """Ids the trainer acknowledged on the current stream."""
        self.acked = asyncio.Event()
        self.outbox: asyncio.Queue[list[trainer_pb2.Trajectory]] = asyncio.Queue()

    def send(self, trajectories: list[trainer_pb2.Trajectory]) -> None:
        """Keep `trajectories` until settled, and queue them for the stream."""
        for traj in trajectories:
            self.unsettled[traj.trajectory_id] = traj
        self.outbox.put_nowait(trajectories)

    async def wait_received(self, ids: list[str]) -> None:
        """Until the trainer has acknowledged (or settled) every one of ids."""
        while not all(i in self.received or i not in self.unsettled for i in ids):
            self.acked.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.acked.wait(), 1.0)

    async def run(self) -> None:
        """Stream to the job's trainer for good: find it, stream, and on a break start again."""
        assert self.runtime.registry is not None
        registry = self.runtime.registry
        while True:
            trainers, _ = await until_etcd_answers(
                lambda: registry.list("trainer"), "looking for the trainer"
            )
            # Rank 0 only (followers serve no data plane); after a restore, the newest epoch.
            bound = sorted(
                (
                    t
                    for t in trainers
                    if t.job_id == self.job_id and t.labels.get("follower") != "true"
                ),
                key=lambda t: t.epoch,
                reverse=True,
            )
            if not bound:
                await asyncio.sleep(0.5)
                continue
            try:
                await self._stream_to(bound[0].address)
            except grpc.aio.AioRpcError as exc:
                log.info("rollout.stream_broken", code=exc.code().name, details=exc.details())
            except asyncio.InvalidStateError:
                # A write that found the call already finished ("RPC already finished"): the
                # trainer went away between two writes.
                log.info("rollout.stream_broken", code="FINISHED", details="written after end")
            except Exception:
                # Any other error is a bug, and the trajectories must still reach the trainer:
                # unhandled, it would end this loop for good while generation goes on (every
                # generated group then waits in `wait_received` forever). Counted and logged
                # with its traceback; the stream opens again and re-sends what is unsettled.
                self.runtime.progress.counters["stream_failures"] = (
                    self.runtime.progress.counters.get("stream_failures", 0.0) + 1
                )
                log.exception("rollout.stream_failed", job=self.job_id)
            self.received.clear()
            await asyncio.sleep(0.5)

    async def _stream_to(self, address: str) -> None:
        """One stream to the trainer until either direction ends; the reader's error (the
        trainer ended the stream) or else the writer's is raised. The writer alone can fail
        while the trainer still answers: the stream is then closed rather than left to wait
        for acknowledgements of trajectories that were never sent."""
        async with open_channel(address) as channel:
            call = trainer_pb2_grpc.TrainerStub(channel).PushTrajectories()
            reader = asyncio.create_task(self._read(call), name=f"acks-{self.job_id}")
            writer = asyncio.create_task(self._write(call), name=f"writes-{self.job_id}")
            try:
                done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                call.cancel()
                for task in (reader, writer):
                    task.cancel()
                # Whatever the other direction raised while being stopped is not the cause.
                await asyncio.gather(reader, writer, return_exceptions=True)
            ended = reader if reader in done else writer
            ended.result()  # raises what ended it (the reader may end cleanly)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for ack in call:
            self.received.update(ack.received_ids)
            for tid in [*ack.committed_ids, *ack.rejected]:
                self.unsettled.pop(tid, None)
                self.received.discard(tid)
            self.acked.set()
            self.runtime.progress.counters["unsettled"] = float(len(self.unsettled))

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
