"""The Trainer gRPC service. Status and control are served here; the trajectory stream
(PushTrajectories) is answered UNIMPLEMENTED until the RL data plane lands."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from robustrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.config import EtcdSettings
from services.common.role_server import RoleControl
from services.common.runtime import ServiceRuntime
from services.trainer.config import TrainerSettings

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerServicer(RoleControl, trainer_pb2_grpc.TrainerServicer):
    async def PushTrajectories(
        self,
        request_iterator: AsyncIterator[trainer_pb2.Trajectory],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_pb2.TrajectoryAck]:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this trainer build has no trajectory stream yet"
        )
        yield trainer_pb2.TrajectoryAck()  # unreachable: makes this an async generator


async def serve(settings: TrainerSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime("trainer", settings, etcd, service_names=[SERVICE_NAME])
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(runtime), runtime.host.server)
    await runtime.start()
    return runtime
