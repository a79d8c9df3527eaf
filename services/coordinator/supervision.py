"""The leader's supervision loop: every `tick_interval` (or at once when woken) a round over
every job. A pending job is started; a running one gets replacements for the roles it lost,
the losses no monitor reported recorded, and the leases of holders that are gone or late
taken back; an ended one has its members released and is forgotten. A round that fails for
one job leaves the others to it."""

from __future__ import annotations

import asyncio
import contextlib
import time

from robustrl.contracts.errors import FailedPrecondition, NotFound
from robustrl.contracts.incidents import new_incident
from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.logs import get_logger
from services.coordinator import jobs, policy, work
from services.coordinator.asks import ProvisioningAsks
from services.coordinator.binding import Binder
from services.coordinator.datasets import Datasets
from services.coordinator.job_records import JobRecords
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.leadership import Leadership
from services.coordinator.ledgers import Ledgers
from services.coordinator.space import SpaceKeeper

log = get_logger(__name__)


class Supervisor:
    def __init__(
        self,
        leadership: Leadership,
        jobs: JobRecords,
        ledgers: Ledgers,
        binder: Binder,
        datasets: Datasets,
        asks: ProvisioningAsks,
        *,
        tick_interval: float,
        unreported_loss_after: float,
        space: SpaceKeeper | None,
    ) -> None:
        """`space`: what gets etcd out of NOSPACE in the rounds; None leaves it to a person."""
        self.leadership = leadership
        self.jobs = jobs
        self.ledgers = ledgers
        self.binder = binder
        self.datasets = datasets
        self.asks = asks
        self.tick_interval = tick_interval
        self.unreported_loss_after = unreported_loss_after
        self.space = space
        self.missing: dict[tuple[str, str], float] = {}
        """(job, bound member) -> since when it is missing from the registry (`unreported`)."""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-driver")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def wake(self) -> None:
        """Supervise now instead of at the next tick (a recovery left a role to fill)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick_interval)
            self._wake.clear()
            if not self.leadership.is_leader:
                continue
            try:
                await self.tick()
            except Exception as exc:  # one bad tick (etcd blip) must not end supervision
                log.warning("coordinator.tick_failed", error=repr(exc))

    async def tick(self) -> None:
        if self.space is not None:
            try:
                await self.space.keep()  # first: under NOSPACE the rest cannot write
            except Exception as exc:
                log.warning("coordinator.etcd_space_check_failed", error=repr(exc))
        records, _ = await self.jobs.store.list_all()
        members, _ = await self.jobs.members.list()
        for listed, _ in records:
            try:
                async with self.jobs.lock(listed.job_id):
                    # Read again under the lock: a recovery that held it while this round
                    # waited has changed the record, and a round acting on the listed copy
                    # wrote its members back (a rollout just fenced was bound again, and no
                    # replacement came for it until the next loss).
                    try:
                        record, _ = await self.jobs.store.get(listed.job_id)
                    except NotFound:
                        continue  # deleted meanwhile
                    await self._tick_job(record, members)
            except Exception as exc:  # one job's trouble must not hold up the others
                log.warning("coordinator.job_tick_failed", job=listed.job_id, error=repr(exc))
        self.binder.prepare_standbys([r for r, _ in records], members)

    async def _tick_job(self, record: JobRecord, members: list[MemberRecord]) -> None:
        unreadable = self.ledgers.unreadable.get(record.job_id)
        if unreadable is None and record.phase not in jobs.TERMINAL:
            unreadable = self.jobs.unsupervisable(record)
        if unreadable is not None:
            if record.phase not in jobs.TERMINAL:
                await self.jobs.fail(record.job_id, unreadable)  # the next tick releases it
            self.ledgers.unreadable.pop(record.job_id, None)
        elif record.phase is Phase.PENDING:
            await self.binder.start_job(record, members)
        elif record.phase in (Phase.RUNNING, Phase.RECOVERING):
            await self.supervise(record, members)
        else:
            await self.release(record.job_id, members)

    async def supervise(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """One round of a running job: fill its lost roles, record unreported losses, take back
        leases that expired or whose holder left, and groups held by nobody."""
        ledger = self.ledgers.ledgers.get(record.job_id)
        if ledger is None:
            return
        await self.binder.fill(record, members)
        await self.unreported(record, members)
        alive = {m.instance_id for m in members if m.job_id == record.job_id}
        changed = work.expire(ledger, time.time())
        for holder in {held.instance_id for held in ledger.open.values()} - alive:
            changed += work.release_holder(ledger, holder, f"{holder} left the registry")
        changed += work.release_lost(ledger, alive)
        if changed:
            log.info("coordinator.groups_requeued", job=record.job_id, groups=len(changed))
            await self.ledgers.save(ledger)

    async def unreported(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """Record the losses `policy.unreported_losses` finds. Once recorded, the incident is
        recovered as any other (its recovery unbinds the member, so it is recorded once)."""
        now = time.time()
        losses = policy.unreported_losses(
            record, members, self.missing, now, self.unreported_loss_after
        )
        for loss in losses:
            subject = policy.leader_subject(record, loss.instance_id)
            await self.jobs.incident_log.record(
                new_incident(subject, "MEMBER_LOST", loss.evidence, 0.9, time.time())
            )
            self.missing[(record.job_id, loss.instance_id)] = now  # once per grace, at most
            log.warning(
                "coordinator.unreported_loss",
                job=record.job_id,
                member=loss.instance_id,
                role=loss.role,
            )

    async def release(self, job_id: str, members: list[MemberRecord]) -> None:
        """An ended job: its leftover groups dropped, its members released, its ETTR account
        closed, and what this leader keeps of it forgotten."""
        ledger = self.ledgers.ledgers.get(job_id)
        if ledger is not None:
            record, _ = await self.jobs.store.get(job_id)
            left = work.settle_leftovers(ledger, f"job {record.phase.value.lower()} first")
            if left:
                await self.ledgers.save(ledger)
        await self.binder.release(job_id, members)
        await self.ledgers.end_account(job_id, time.time())
        awaited = self.asks.awaiting(job_id)
        self.forget(job_id)
        if awaited:
            await self.asks.save(job_id)  # none now: deletes the stored asks

    def forget(self, job_id: str) -> None:
        """Drop what this leader keeps in memory for a job that has ended (its records stay
        in etcd): a leader that runs for months must not grow with every job it ran."""
        self.ledgers.forget(job_id)
        self.datasets.forget(job_id)
        self.binder.forget(job_id)
        self.asks.forget(job_id)
        for key in [k for k in self.missing if k[0] == job_id]:
            del self.missing[key]

    async def delete_job(self, job_id: str, guard: list[object]) -> int:
        """Remove an ended job's state from etcd (JobStore.delete); return the keys deleted.
        Members still bound to the job are released first (as the supervision round would);
        FailedPrecondition while the job has not ended or a member could not be released."""
        async with self.jobs.lock(job_id):
            record, revision = await self.jobs.store.get(job_id)
            if record.phase not in jobs.TERMINAL:
                raise FailedPrecondition(
                    f"job {job_id!r} is {record.phase.value}; cancel it before deleting it"
                )
            members, _ = await self.jobs.registry.list()
            if any(m.job_id == job_id for m in members):
                await self.release(job_id, members)
                members, _ = await self.jobs.registry.list()
            bound = sorted(m.instance_id for m in members if m.job_id == job_id)
            if bound:
                raise FailedPrecondition(
                    f"job {job_id!r} still has members bound to it that did not answer a "
                    f"release ({', '.join(bound)}); retry once they are released or gone"
                )
            deleted = await self.jobs.store.delete(job_id, revision, guard)
            self.forget(job_id)
        log.info("coordinator.job_deleted", job=job_id, keys=deleted)
        return deleted
