"""The Rollout gRPC service. Status and control are served here; generation is driven by
the RL data plane."""

from __future__ import annotations

from robustrl.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.config import EtcdSettings
from services.common.role_server import RoleControl
from services.common.runtime import ServiceRuntime
from services.rollout.config import RolloutSettings

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


class RolloutServicer(RoleControl, rollout_pb2_grpc.RolloutServicer):
    """Status and control; generation is driven by the RL data plane."""


async def serve(settings: RolloutSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime("rollout", settings, etcd, service_names=[SERVICE_NAME])
    rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(runtime), runtime.host.server)
    await runtime.start()
    return runtime
