"""Status and control shared by the data-plane roles (trainer, rollout)."""

from __future__ import annotations

import grpc

from robustrl.v1 import trainer_pb2
from services.common.control import Binding, apply_control
from services.common.logs import get_logger
from services.common.registry import ROLE_TO_PROTO
from services.common.runtime import ServiceRuntime

log = get_logger(__name__)


class RoleControl:
    """GetStatus / Control handlers, mixed into the servicers of both roles."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.binding = Binding(epoch=runtime.settings.epoch)

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
        self.binding = apply_control(before, request.action, request.job_id, request.epoch)
        if self.binding != before:
            self.runtime.progress.job_id = self.binding.job_id
            await self.runtime.update_member(job_id=self.binding.job_id, epoch=self.binding.epoch)
            log.info(
                f"{self.runtime.role}.control",
                action=trainer_pb2.ControlRequest.Action.Name(request.action),
                job=self.binding.job_id,
                epoch=self.binding.epoch,
            )
        return trainer_pb2.ControlResponse(status=self.status())
