"""Status and control shared by the data-plane roles (trainer, rollout).

BIND carries the job's spec; the role builds a worker for it (loading the model in a thread)
and only then accepts the binding, so a bad spec or a missing model is refused with a clear
error instead of failing later. RELEASE and FENCE stop the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import grpc
import pydantic

from robustrl.v1 import trainer_pb2
from services.common.control import Binding, apply_control
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.jobspec import JobSpec
from services.common.logs import get_logger
from services.common.registry import ROLE_TO_PROTO
from services.common.runtime import ServiceRuntime

log = get_logger(__name__)

Action = trainer_pb2.ControlRequest


class Worker(Protocol):
    job_id: str

    def load(self) -> None:
        """Blocking set-up (model, reward plug-in); raises InvalidArgument on bad input."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


WorkerFactory = Callable[[str, int, JobSpec], Worker]


def spec_from_args(args: dict[str, str]) -> JobSpec:
    if "spec_json" not in args:
        raise InvalidArgument("BIND needs the job spec in args['spec_json']")
    try:
        return JobSpec.model_validate_json(args["spec_json"])
    except pydantic.ValidationError as exc:
        raise InvalidArgument(f"the job spec does not validate: {exc.errors()[0]['msg']}") from exc


class RoleControl:
    """GetStatus / Control handlers, mixed into the servicers of both roles."""

    def __init__(self, runtime: ServiceRuntime, make_worker: WorkerFactory) -> None:
        self.runtime = runtime
        self.make_worker = make_worker
        self.binding = Binding(epoch=runtime.settings.epoch)
        self.worker: Worker | None = None

    def status(self) -> trainer_pb2.RoleStatus:
        progress = self.runtime.progress
        status = trainer_pb2.RoleStatus(
            role=ROLE_TO_PROTO[self.runtime.role],
            instance_id=self.runtime.instance_id,
            epoch=self.binding.epoch,
            job_id=self.binding.job_id,
            phase="fenced" if self.binding.fenced else progress.phase,
            step=int(progress.counters.get("step", 0)),
            weight_version=int(progress.counters.get("weight_version", 0)),
        )
        status.metrics.update(progress.counters)
        return status

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.RoleStatus:
        return self.status()

    async def Control(
        self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ControlResponse:
        before = self.binding
        after = apply_control(before, request.action, request.job_id, request.epoch)
        worker: Worker | None = None
        if request.action == Action.ACTION_BIND:
            if self.worker is not None:
                raise FailedPrecondition(f"already working on job {self.worker.job_id}")
            worker = self.make_worker(
                request.job_id, request.epoch, spec_from_args(dict(request.args))
            )
            await asyncio.to_thread(worker.load)
        self.binding = after
        if after != before:
            self.runtime.progress.job_id = after.job_id
            await self.runtime.update_member(job_id=after.job_id, epoch=after.epoch)
            log.info(
                f"{self.runtime.role}.control",
                action=trainer_pb2.ControlRequest.Action.Name(request.action),
                job=after.job_id,
                epoch=after.epoch,
            )
        if worker is not None:
            self.worker = worker
            self.runtime.progress.phase = "working"
            worker.start()
        elif request.action in (Action.ACTION_RELEASE, Action.ACTION_FENCE):
            await self.stop_worker()
        return trainer_pb2.ControlResponse(status=self.status())

    async def stop_worker(self) -> None:
        if self.worker is not None:
            worker, self.worker = self.worker, None
            await worker.stop()
            self.runtime.progress.phase = "idle"
