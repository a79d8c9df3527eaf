"""The Rollout gRPC service: status and control (BIND starts generating for the job), and the
probe the monitor asks when a rollout looks hung."""

from __future__ import annotations

import grpc

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.config import EtcdSettings
from robustrl.core.role_server import RoleControl
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import rollout_pb2, rollout_pb2_grpc
from services.rollout.config import RolloutSettings
from services.rollout.worker import RolloutWorker

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name

MAX_PROBE_WAIT_S = 60.0
"""Longest wait a probe may ask for: it holds an RPC (and the monitor's probe task) open."""


class RolloutServicer(RoleControl, rollout_pb2_grpc.RolloutServicer):
    def __init__(self, runtime: ServiceRuntime, settings: RolloutSettings) -> None:
        def make_worker(job_id: str, epoch: int, spec: JobSpec) -> RolloutWorker:
            return RolloutWorker(runtime, settings, job_id=job_id, epoch=epoch, spec=spec)

        super().__init__(runtime, make_worker)

    async def Probe(
        self, request: rollout_pb2.ProbeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ProbeResponse:
        # `not (a < x <= b)` also refuses NaN.
        if not 0 < request.wait_s <= MAX_PROBE_WAIT_S:
            raise InvalidArgument(
                f"wait_s must be in (0, {MAX_PROBE_WAIT_S:.0f}] seconds, got {request.wait_s}"
            )
        worker = self.worker
        if not isinstance(worker, RolloutWorker):
            return rollout_pb2.ProbeResponse(
                progressing=True,
                requests_in_flight=0,
                tokens_generated=self.runtime.progress.counters.get("tokens_generated", 0.0),
                detail="idle: no job bound",
            )
        # Waits on the event loop for the generation thread's token count to move.
        result = await worker.meter.probe(request.wait_s)
        return rollout_pb2.ProbeResponse(
            progressing=result.progressing,
            requests_in_flight=result.requests_in_flight,
            tokens_generated=result.tokens_generated,
            detail=result.detail,
        )


async def start(settings: RolloutSettings, etcd: EtcdSettings) -> RolloutServicer:
    """Start a rollout; the servicer is how an in-process caller (a test) reaches its worker."""
    runtime = ServiceRuntime(
        "rollout",
        settings,
        etcd,
        service_names=[SERVICE_NAME],
        labels=settings.labels(),
    )
    servicer = RolloutServicer(runtime, settings)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, runtime.host.server)
    await runtime.start(on_fenced=servicer.fenced)
    runtime.host.before_stop.insert(0, servicer.stop_worker)
    return servicer


async def serve(settings: RolloutSettings, etcd: EtcdSettings) -> ServiceRuntime:
    return (await start(settings, etcd)).runtime
