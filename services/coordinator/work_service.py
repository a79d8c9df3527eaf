"""The work service of the data plane: rollouts lease prompt groups from the job's dataset and
complete them (LeaseWork, CompleteWork); the trainer reports its progress (ReportProgress),
which the leader turns into job state, ledger changes and ETTR time. Every change is written
to etcd before it is answered."""

from __future__ import annotations

import asyncio
import time

from robustrl.contracts.errors import FailedPrecondition, InvalidArgument, Unavailable
from robustrl.contracts.ids import group_index
from robustrl.contracts.incidents import IncidentRecord, new_incident
from robustrl.contracts.members import MemberRecord
from robustrl.core.interceptors import REPEAT_WINDOW_S, Repeats
from robustrl.core.logs import get_logger
from robustrl.v1 import coordinator_pb2
from services.coordinator import jobs, policy, work
from services.coordinator.datasets import Datasets
from services.coordinator.job_records import JobRecords
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.ledgers import Ledgers

log = get_logger(__name__)

MAX_REQUEST_ID = 128
"""The longest LeaseWork request_id taken (the ledger keeps each rollout's last one)."""

ACCOUNTING_ONLY = frozenset({"step_started_at", "step_work_started_at", "step_ended_at"})
"""Progress metrics that feed ETTR and are not kept in the job record."""


class WorkService:
    def __init__(
        self, jobs: JobRecords, ledgers: Ledgers, datasets: Datasets, *, lease_seconds: float
    ) -> None:
        self.jobs = jobs
        self.ledgers = ledgers
        self.datasets = datasets
        self.lease_seconds = lease_seconds
        self._undone = Repeats(REPEAT_WINDOW_S)
        """Which `coordinator.lease_undone` lines to write (one per member per window)."""

    async def bound_member(self, record: JobRecord, role: str, instance_id: str) -> MemberRecord:
        """The registry's record of a member that serves the job; FailedPrecondition when it
        does not (fenced, replaced or released), Unavailable while it is out of the registry."""
        if record.member_roles and instance_id not in record.member_roles:
            raise FailedPrecondition(
                f"{role} {instance_id} no longer serves job {record.job_id} (fenced or replaced)"
            )
        member = await self.jobs.registry.get(role, instance_id)
        if member is None and instance_id in record.member_roles:
            # Still the job's member, out of the registry: its session lapsed (an etcd outage)
            # and it has not registered again yet, or it died and will be reported lost. Not a
            # refusal: one would stop a live trainer for good.
            raise Unavailable(
                f"{role} {instance_id} of job {record.job_id} is not in the registry now; "
                "retry once it has registered again"
            )
        if member is None or member.job_id != record.job_id:
            raise FailedPrecondition(f"{role} {instance_id} is not bound to job {record.job_id}")
        return member

    async def lease_work(
        self, request: coordinator_pb2.LeaseWorkRequest
    ) -> coordinator_pb2.LeaseWorkResponse:
        if request.max_groups < 1:
            raise InvalidArgument("max_groups must be >= 1")
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID} characters")
        saved: asyncio.Future[None] | None = None
        async with self.jobs.lock(request.job_id):
            record, _ = await self.jobs.store.get(request.job_id)
            if record.phase in jobs.TERMINAL:
                return coordinator_pb2.LeaseWorkResponse(job_done=True)
            # RECOVERING too: rollouts keep generating while a trainer is restored.
            running = record.phase in (Phase.RUNNING, Phase.RECOVERING)
            if not running or request.job_id not in self.ledgers.ledgers:
                return coordinator_pb2.LeaseWorkResponse(retry_after_s=0.5)
            await self.bound_member(record, "rollout", request.instance_id)
            spec = self.jobs.spec(record)
            ledger = self.ledgers.ledger(request.job_id)
            again = work.retried_ask(ledger, request.instance_id, request.epoch, request.request_id)
            granted = work.lease(
                ledger,
                instance_id=request.instance_id,
                epoch=request.epoch,
                max_groups=request.max_groups,
                budget=spec.trainer.groups_per_step * (spec.trainer.max_staleness + 1),
                now=time.time(),
                lease_seconds=self.lease_seconds,
                request_id=request.request_id,
            )
            if again is not None:
                log.info(
                    "coordinator.lease_answered_again",
                    job=request.job_id,
                    member=request.instance_id,
                    groups=len(granted),
                )
            if granted:
                saved = self.ledgers.changed(ledger)
            dataset = self.datasets.of(request.job_id, spec)
            reply = coordinator_pb2.LeaseWorkResponse(
                min_weight_version=record.weight_version,
                retry_after_s=0.0 if granted else 0.2,
            )
            deadline = time.time() + self.lease_seconds
            for group in granted:
                item = dataset[group_index(group) % len(dataset)]
                msg = reply.groups.add(
                    group_id=group,
                    item_id=item.id,
                    prompt=item.prompt,
                    answer=item.answer,
                    group_size=spec.rollout.group_size,
                    messages=[
                        coordinator_pb2.ChatMessage(role=m.role, content=m.content)
                        for m in item.messages
                    ],
                )
                msg.lease_deadline.FromNanoseconds(int(deadline * 1e9))
        if saved is not None:
            # Outside the lock: leases asked for while this write is in flight share the next.
            try:
                await saved
            except BaseException:
                # Not stored, and not answered: held for nobody, these groups would wait out
                # their lease (a minute) and, with enough failed asks in an etcd outage, fill
                # the job's budget so that nothing else is leased meanwhile.
                await self._unlease(request.job_id, request.instance_id, list(granted))
                raise
        return reply

    async def _unlease(self, job_id: str, instance_id: str, granted: list[str]) -> None:
        async with self.jobs.lock(job_id):
            ledger = self.ledgers.ledgers.get(job_id)
            if ledger is None or not (back := work.unlease(ledger, instance_id, granted)):
                return
            # The next write carries it; nobody waits for that one.
            self.ledgers.changed(ledger).add_done_callback(_retrieve)
        unlogged = self._undone.admit((job_id, instance_id))
        if unlogged is not None:  # through an outage every ask is undone: once per window
            log.info(
                "coordinator.lease_undone",
                job=job_id,
                member=instance_id,
                groups=len(back),
                unlogged=unlogged,
            )

    async def complete_work(self, request: coordinator_pb2.CompleteWorkRequest) -> None:
        async with self.jobs.lock(request.job_id):
            record, _ = await self.jobs.store.get(request.job_id)
            if record.phase in jobs.TERMINAL:
                return
            await self.bound_member(record, "rollout", request.instance_id)
            if request.error:
                verdict = policy.rollout_error_verdict(request.instance_id, request.error)
                await self.jobs.fail(request.job_id, verdict)
                return
            ledger = self.ledgers.ledger(request.job_id)
            ignored = work.complete(ledger, request.instance_id, list(request.group_ids))
            ignored += work.give_back(ledger, request.instance_id, dict(request.returned))
            if request.generated_to > request.generated_from > 0:
                self.ledgers.note_generated(
                    request.job_id,
                    set(request.group_ids) - set(ignored),
                    request.generated_from,
                    request.generated_to,
                )
            if ignored:
                log.debug(
                    "coordinator.completion_ignored",
                    job=request.job_id,
                    member=request.instance_id,
                    groups=ignored,
                )
            saved = self.ledgers.changed(ledger)
        await saved  # outside the lock, as in lease_work

    async def report_progress(
        self, request: coordinator_pb2.ReportProgressRequest
    ) -> coordinator_pb2.ReportProgressResponse:
        """Record the trainer's report; the answer says whether it goes on, and the job's step
        budget now, which an UpdateJob (under the same lock) may have changed."""
        stop = coordinator_pb2.ReportProgressResponse(keep_going=False)
        async with self.jobs.lock(request.job_id):
            read = await self.jobs.store.get(request.job_id)
            record = read[0]
            if record.phase in jobs.TERMINAL:
                return stop
            await self.bound_member(record, "trainer", request.instance_id)
            rank = record.member_ranks.get(request.instance_id, 0)
            if rank:
                raise FailedPrecondition(
                    f"trainer {request.instance_id} is rank {rank} of job {record.job_id}'s "
                    "group; only rank 0 reports progress"
                )
            if request.error:
                await self._trainer_error(record, request)
                return stop
            ledger = self.ledgers.ledgers.get(request.job_id)
            if ledger is not None:
                discarded = dict(request.discarded_groups)
                ignored = work.record_progress(
                    ledger,
                    list(request.trained_group_ids),
                    discarded,
                    await self.ledgers.paged_out_drops(ledger, discarded),
                    step=request.step,
                    durable=request.durable_step,
                    restored=request.restored_step,
                )
                if ignored:
                    # Already settled (a report sent again) or never leased: counted once.
                    log.info("coordinator.progress_ignored", job=request.job_id, groups=ignored)
                regenerate = dict(request.regenerate_groups)
                paged_out = await self.ledgers.paged_out_drops(ledger, regenerate)
                again = work.regenerate(ledger, regenerate, paged_out)
                if again:
                    log.info("coordinator.groups_requeued", job=request.job_id, groups=again)
                await self.ledgers.save(ledger)
            self.ledgers.account_progress(ledger, request)
            change: dict[str, object] = {
                "step": request.step,
                "weight_version": request.weight_version,
                "metrics": {
                    **record.metrics,
                    **{k: v for k, v in request.metrics.items() if k not in ACCOUNTING_ONLY},
                },
            }
            spec = self.jobs.spec(record)
            if request.finished:
                await self.jobs.update(
                    request.job_id,
                    change,
                    Phase.SUCCEEDED,
                    f"completed {request.step}/{spec.trainer.steps} steps",
                    read=read,
                )
                log.info("coordinator.job_succeeded", job=request.job_id, step=request.step)
                await self.ledgers.save_account(request.job_id)
                return stop
            await self.jobs.update(request.job_id, change, read=read)
            await self.ledgers.save_account(request.job_id)
            return coordinator_pb2.ReportProgressResponse(keep_going=True, steps=spec.trainer.steps)

    async def _trainer_error(
        self, record: JobRecord, request: coordinator_pb2.ReportProgressRequest
    ) -> None:
        """The trainer stopped on an error and said so: the job fails, or the error is recorded
        as a TRAINER_ERROR incident and recovered as a lost trainer, as
        `policy.trainer_error_verdict` says."""
        incidents = self.jobs.incident_log
        earlier: list[IncidentRecord] = []  # an error in the job fails it: no log read
        if not request.error_in_job:
            earlier, _ = await incidents.list(record.job_id, kind="TRAINER_ERROR")
        verdict = policy.trainer_error_verdict(
            request.instance_id,
            request.error,
            in_job=request.error_in_job,
            step=request.step,
            epoch=record.epoch,
            earlier=earlier,
        )
        if verdict.fail:
            await self.jobs.fail(record.job_id, verdict.fail)
            return
        if not verdict.recover:
            return
        subject = policy.leader_subject(record, request.instance_id)
        evidence = f"stopped at step {request.step} on an error: {request.error}"
        await incidents.record(
            new_incident(subject, "TRAINER_ERROR", evidence, 1.0, time.time(), step=request.step)
        )
        log.warning(
            "coordinator.trainer_error",
            job=record.job_id,
            member=request.instance_id,
            step=request.step,
            error=request.error,
        )


def _retrieve(done: asyncio.Future[None]) -> None:
    """Take a future's outcome so that a failure nobody awaits is not logged as unretrieved."""
    if not done.cancelled():
        done.exception()
