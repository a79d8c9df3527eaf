"""The Rollout gRPC service: status and control; BIND starts generating for the job."""

from __future__ import annotations

from robustrl.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.config import EtcdSettings
from services.common.jobspec import JobSpec
from services.common.role_server import RoleControl
from services.common.runtime import ServiceRuntime
from services.rollout.config import RolloutSettings
from services.rollout.worker import RolloutWorker

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


class RolloutServicer(RoleControl, rollout_pb2_grpc.RolloutServicer):
    def __init__(self, runtime: ServiceRuntime, settings: RolloutSettings) -> None:
        def make_worker(job_id: str, epoch: int, spec: JobSpec) -> RolloutWorker:
            return RolloutWorker(runtime, settings, job_id=job_id, epoch=epoch, spec=spec)

        super().__init__(runtime, make_worker)


async def serve(settings: RolloutSettings, etcd: EtcdSettings) -> ServiceRuntime:
    runtime = ServiceRuntime("rollout", settings, etcd, service_names=[SERVICE_NAME])
    servicer = RolloutServicer(runtime, settings)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, runtime.host.server)
    await runtime.start()
    runtime.host.before_stop.insert(0, servicer.stop_worker)
    return runtime
