"""The Coordinator gRPC service: validate the request, call the core, convert protos."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from robustrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.config import EtcdSettings
from services.common.errors import Aborted, InvalidArgument
from services.common.jobspec import parse_spec, validate_job_id
from services.common.logs import get_logger
from services.common.registry import ROLE_FROM_PROTO, member_to_proto
from services.common.runtime import ServiceRuntime
from services.coordinator import jobs
from services.coordinator.config import CoordinatorSettings
from services.coordinator.driver import JobDriver
from services.coordinator.jobs import Phase
from services.coordinator.leadership import Leadership
from services.coordinator.provisioner import LocalProvisioner
from services.coordinator.store import JobStore

log = get_logger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, runtime: ServiceRuntime, leadership: Leadership, driver: JobDriver) -> None:
        self.runtime = runtime
        self.leadership = leadership
        self.driver = driver

    @property
    def store(self) -> JobStore:
        assert self.runtime.client is not None
        return JobStore(self.runtime.client, self.runtime.keys)

    async def SubmitJob(
        self, request: coordinator_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Job:
        spec = parse_spec(request.spec, list(request.overrides))
        guard = await self.leadership.require_leader()
        job_id = request.job_id or spec.id or f"{spec.name}-{secrets.token_hex(3)}"
        validate_job_id(job_id)
        record = jobs.new_job(
            job_id, spec.model_copy(update={"id": job_id}).model_dump(mode="json"), jobs.now()
        )
        revision = await self.store.create(record, guard)
        log.info("coordinator.job_submitted", job=job_id, name=spec.name)
        return jobs.to_proto(record, revision)

    async def GetJob(
        self, request: coordinator_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Job:
        record, revision = await self.store.get(validate_job_id(request.job_id))
        return jobs.to_proto(record, revision)

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListJobsResponse:
        wanted = {jobs.phase_from_proto(p) for p in request.phases}
        records, revision = await self.store.list_all()
        return coordinator_pb2.ListJobsResponse(
            jobs=[jobs.to_proto(r, rev) for r, rev in records if not wanted or r.phase in wanted],
            revision=revision,
        )

    async def CancelJob(
        self, request: coordinator_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Job:
        job_id = validate_job_id(request.job_id)
        guard = await self.leadership.require_leader()
        reason = request.reason or "cancelled by user"
        # Under the driver's job lock, so the leader's own updates never race it; an
        # unconditional cancel also re-reads and retries a lost compare-and-swap.
        async with self.driver.lock(job_id):
            attempt = 0
            while True:
                attempt += 1
                record, revision = await self.store.get(job_id)
                if request.expected_revision and request.expected_revision != revision:
                    raise Aborted(
                        f"job {job_id!r} is at revision {revision}, not "
                        f"{request.expected_revision}; re-read it and retry"
                    )
                updated = jobs.transition(record, Phase.CANCELLED, reason, jobs.now())
                try:
                    new_revision = await self.store.update(updated, revision, guard)
                except Aborted:
                    if request.expected_revision or attempt >= 5:
                        raise
                    continue
                log.info("coordinator.job_cancelled", job=job_id, reason=reason)
                return jobs.to_proto(updated, new_revision)

    async def WatchJob(
        self, request: coordinator_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.JobEvent]:
        job_id = validate_job_id(request.job_id)
        if request.after_revision < 0:
            raise InvalidArgument("after_revision must be >= 0")
        record, revision = await self.store.get(job_id)
        after = request.after_revision
        if after == 0 or after < revision:
            yield _event(record, revision)
            after = revision
        async for record, revision in self.store.watch(job_id, after):
            yield _event(record, revision)

    async def ListMembers(
        self, request: coordinator_pb2.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListMembersResponse:
        assert self.runtime.registry is not None
        role = ROLE_FROM_PROTO.get(request.role) if request.role else None
        members, revision = await self.runtime.registry.list(role)
        leader = await self.leadership.leader()
        leader_id = leader["instance_id"] if leader else ""
        return coordinator_pb2.ListMembersResponse(
            members=[
                member_to_proto(m, leader=m.role == "coordinator" and m.instance_id == leader_id)
                for m in members
            ],
            revision=revision,
            leader_instance_id=leader_id,
        )

    async def LeaseWork(
        self, request: coordinator_pb2.LeaseWorkRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaseWorkResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        return await self.driver.lease_work(request)

    async def CompleteWork(
        self, request: coordinator_pb2.CompleteWorkRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteWorkResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        await self.driver.complete_work(request)
        return coordinator_pb2.CompleteWorkResponse()

    async def ReportProgress(
        self, request: coordinator_pb2.ReportProgressRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReportProgressResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        keep_going = await self.driver.report_progress(request)
        return coordinator_pb2.ReportProgressResponse(keep_going=keep_going)


def _event(record: jobs.JobRecord, revision: int) -> coordinator_pb2.JobEvent:
    observed = Timestamp()
    observed.GetCurrentTime()
    return coordinator_pb2.JobEvent(
        job=jobs.to_proto(record, revision), revision=revision, observed_at=observed
    )


async def serve(settings: CoordinatorSettings, etcd: EtcdSettings) -> ServiceRuntime:
    """Start a coordinator replica: server, registration, campaign. Returns its runtime."""
    runtime = ServiceRuntime("coordinator", settings, etcd, service_names=[SERVICE_NAME])

    driver: JobDriver | None = None

    async def on_elected() -> None:
        assert runtime.client is not None and driver is not None
        records, _ = await JobStore(runtime.client, runtime.keys).list_all()
        active = sum(1 for r, _ in records if r.phase not in jobs.TERMINAL)
        log.info("coordinator.jobs_reloaded", jobs=len(records), active=active)
        await driver.on_elected()

    leadership = Leadership(runtime, settings.election_name, on_elected)
    driver = JobDriver(
        runtime,
        leadership,
        tick_interval=settings.tick_interval,
        lease_seconds=settings.lease_seconds,
    )
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
        CoordinatorServicer(runtime, leadership, driver), runtime.host.server
    )
    await runtime.start()
    if settings.provisioner == "local":
        assert runtime.client is not None
        driver.provisioner = LocalProvisioner(
            runtime.client, runtime.keys, etcd, settings.provision_log_dir
        )
    leadership.start()
    driver.start()
    runtime.host.before_stop.insert(0, leadership.resign)
    runtime.host.before_stop.insert(0, driver.stop)
    return runtime
