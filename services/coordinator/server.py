"""The Coordinator gRPC service: validate the request, call the core, convert protos."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from robustrl.contracts.errors import Aborted, FailedPrecondition, InvalidArgument
from robustrl.contracts.jobspec import parse_spec, validate_job_id
from robustrl.contracts.members import member_to_proto
from robustrl.contracts.provisioning import ACCEPTED_METADATA_KEY
from robustrl.contracts.roles import ROLE_FROM_PROTO
from robustrl.core.config import EtcdSettings
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    provisioning_pb2,
    provisioning_pb2_grpc,
)
from services.coordinator import jobs
from services.coordinator.config import CoordinatorSettings
from services.coordinator.datasets import dataset_for
from services.coordinator.driver import JobDriver
from services.coordinator.jobs import Phase
from services.coordinator.leadership import Leadership
from services.coordinator.provisioner import ExternalProvisioner, LocalProvisioner, Scheduler
from services.coordinator.space import SpaceKeeper
from services.coordinator.store import JobStore

log = get_logger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
PROVISIONING_SERVICE_NAME = provisioning_pb2.DESCRIPTOR.services_by_name["Provisioning"].full_name


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, runtime: ServiceRuntime, leadership: Leadership, driver: JobDriver) -> None:
        self.runtime = runtime
        self.leadership = leadership
        self.driver = driver
        self._listed: dict[str | None, tuple[tuple[int, str], coordinator_pb2.ListMembersResponse]]
        self._listed = {}
        """Role -> the last ListMembers answer, with the (revision, leader) it was built at."""

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
        # The rows are read now: a job whose data cannot be had is refused, not recorded.
        items = await asyncio.to_thread(dataset_for, spec)
        record = jobs.new_job(
            job_id, spec.model_copy(update={"id": job_id}).model_dump(mode="json"), jobs.now()
        )
        revision = await self.store.create(record, guard)
        self.driver.datasets.keep(job_id, items)
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

    async def UpdateJob(
        self, request: coordinator_pb2.UpdateJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Job:
        job_id = validate_job_id(request.job_id)
        steps = jobs.requested_steps(list(request.overrides))
        guard = await self.leadership.require_leader()
        # As CancelJob: under the job lock, so that the step it checks against is the one the
        # trainer's reports leave; a lost compare-and-swap is re-read and checked again.
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
                updated = jobs.with_steps(record, steps, jobs.now())
                if updated is record:
                    return jobs.to_proto(record, revision)
                try:
                    new_revision = await self.store.update(updated, revision, guard)
                except Aborted:
                    if request.expected_revision or attempt >= 5:
                        raise
                    continue
                log.info("coordinator.job_updated", job=job_id, steps=steps, step=record.step)
                return jobs.to_proto(updated, new_revision)

    async def DeleteJob(
        self, request: coordinator_pb2.DeleteJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DeleteJobResponse:
        job_id = validate_job_id(request.job_id)
        guard = await self.leadership.require_leader()
        deleted = await self.driver.delete_job(job_id, guard)
        return coordinator_pb2.DeleteJobResponse(job_id=job_id, keys_deleted=deleted)

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
        role = ROLE_FROM_PROTO.get(request.role) if request.role else None
        cache = self.driver.jobs.members
        if await cache.current():
            members, revision = await cache.list(role)
        else:  # a change the watch has not delivered yet: what was written before the call
            assert self.runtime.registry is not None
            members, revision = await self.runtime.registry.list(role)
        leader = await self.leadership.leader()
        leader_id = leader["instance_id"] if leader else ""
        last = self._listed.get(role)
        if last is not None and last[0] == (revision, leader_id):
            return last[1]  # nothing changed since: the last answer is this one
        reply = coordinator_pb2.ListMembersResponse(
            members=[
                member_to_proto(m, leader=m.role == "coordinator" and m.instance_id == leader_id)
                for m in members
            ],
            revision=revision,
            leader_instance_id=leader_id,
        )
        self._listed[role] = ((revision, leader_id), reply)
        return reply

    async def LeaseWork(
        self, request: coordinator_pb2.LeaseWorkRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaseWorkResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        return await self.driver.work.lease_work(request)

    async def CompleteWork(
        self, request: coordinator_pb2.CompleteWorkRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteWorkResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        await self.driver.work.complete_work(request)
        return coordinator_pb2.CompleteWorkResponse()

    async def ReportProgress(
        self, request: coordinator_pb2.ReportProgressRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReportProgressResponse:
        validate_job_id(request.job_id)
        await self.leadership.require_leader()
        return await self.driver.work.report_progress(request)


class ProvisioningServicer(provisioning_pb2_grpc.ProvisioningServicer):
    """The `external` provisioner's stream (protos/robustrl/v1/provisioning.proto)."""

    def __init__(self, leadership: Leadership, driver: JobDriver) -> None:
        self.leadership = leadership
        self.driver = driver

    async def Provision(
        self,
        request_iterator: AsyncIterator[provisioning_pb2.ProvisionerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[provisioning_pb2.ProvisionRequest]:
        # The hello is read before any refusal: a stream ended while the scheduler's first
        # write is in flight reached it as INTERNAL, not as the refusal's own code.
        first = await anext(aiter(request_iterator), None)
        await self.leadership.require_leader()
        provisioner = self.driver.provisioner
        if not isinstance(provisioner, ExternalProvisioner):
            raise FailedPrecondition(
                "this coordinator does not take an external provisioner; start it with "
                "ROBUSTRL_COORDINATOR_PROVISIONER=external"
            )
        if first is None or not first.HasField("hello"):
            raise InvalidArgument("the first message on the stream must be a hello")
        scheduler = provisioner.connect(first.hello)
        # Tells the scheduler it was accepted before any request comes.
        await context.send_initial_metadata(((ACCEPTED_METADATA_KEY, scheduler.name),))
        # Reports arrive while requests go out: the reader hands its outcome to the writer.
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._read(request_iterator, provisioner, scheduler, ended))
        getter: asyncio.Future[provisioning_pb2.ProvisionRequest] | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(scheduler.outbox.get())
                either: list[asyncio.Future[Any]] = [getter, ended]
                await asyncio.wait(either, timeout=1.0, return_when="FIRST_COMPLETED")
                if getter.done():
                    request, getter = getter.result(), None
                    yield request
                elif ended.done():
                    ended.result()  # the reader's error, if it stopped on one
                    return
                else:
                    await self.leadership.require_leader()  # a deposed leader ends the stream
        finally:
            # A request taken from the outbox but not sent is still pending: disconnect
            # sends it elsewhere, like every other one this scheduler did not report on.
            if getter is not None:
                getter.cancel()
            reader.cancel()
            provisioner.disconnect(scheduler)

    @staticmethod
    async def _read(
        messages: AsyncIterator[provisioning_pb2.ProvisionerMessage],
        provisioner: ExternalProvisioner,
        scheduler: Scheduler,
        ended: asyncio.Future[None],
    ) -> None:
        try:
            async for message in messages:
                if not message.HasField("report"):
                    raise InvalidArgument("only reports may follow the hello")
                provisioner.report(scheduler, message.report)
        except Exception as exc:
            ended.set_exception(exc)
        else:
            ended.set_result(None)


def _event(record: jobs.JobRecord, revision: int) -> coordinator_pb2.JobEvent:
    observed = Timestamp()
    observed.GetCurrentTime()
    return coordinator_pb2.JobEvent(
        job=jobs.to_proto(record, revision), revision=revision, observed_at=observed
    )


async def serve(settings: CoordinatorSettings, etcd: EtcdSettings) -> ServiceRuntime:
    """Start a coordinator replica: server, registration, campaign. Returns its runtime."""
    runtime = ServiceRuntime(
        "coordinator", settings, etcd, service_names=[SERVICE_NAME, PROVISIONING_SERVICE_NAME]
    )

    driver: JobDriver | None = None

    async def on_elected() -> None:
        assert runtime.client is not None and driver is not None
        records, _ = await JobStore(runtime.client, runtime.keys).list_all()
        active = sum(1 for r, _ in records if r.phase not in jobs.TERMINAL)
        log.info("coordinator.jobs_reloaded", jobs=len(records), active=active)
        await driver.on_elected()

    leadership = Leadership(runtime, settings.election_name, on_elected)
    space = SpaceKeeper(lambda: runtime.client, etcd) if settings.etcd_space_recovery else None
    driver = JobDriver(
        runtime,
        leadership,
        tick_interval=settings.tick_interval,
        lease_seconds=settings.lease_seconds,
        ledger_page_size=settings.ledger_page_size,
        unreported_loss_after=settings.unreported_loss_after,
        space=space,
    )
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
        CoordinatorServicer(runtime, leadership, driver), runtime.host.server
    )
    provisioning_pb2_grpc.add_ProvisioningServicer_to_server(
        ProvisioningServicer(leadership, driver), runtime.host.server
    )
    # A replica that starts while etcd is full frees it itself: it may be the only one.
    await runtime.start(free_space=space.keep if space is not None else None)
    if settings.provisioner == "local":
        assert runtime.client is not None
        driver.provisioner = LocalProvisioner(
            runtime.client,
            runtime.keys,
            etcd,
            settings.provision_log_dir,
            template=settings.provision_template,
            template_socket=settings.provision_template_socket,
        )
    elif settings.provisioner == "external":
        driver.provisioner = ExternalProvisioner(etcd)
    driver.provisioner.on_failure = driver.provision_failed
    leadership.start()
    driver.start()
    runtime.host.before_stop.insert(0, leadership.resign)
    runtime.host.before_stop.insert(0, driver.stop)
    return runtime
