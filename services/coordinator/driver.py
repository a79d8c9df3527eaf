"""What the leader does for running jobs: bind members, lease work, record progress.

The leader binds a PENDING job to a free trainer and `rollout.replicas` free rollouts found
in the registry (Control BIND with the job's spec and an epoch), leases prompt groups to the
rollouts from the job's dataset, and turns the trainer's progress reports into job state.
It runs a supervision tick that takes back leases whose holder is gone or late, and releases
members of finished jobs. Everything it decides is written to etcd before it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import TypeAlias

import grpc
from pydantic import ValidationError

from robustrl.contracts import packed
from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.contracts.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from robustrl.contracts.ettr import EttrAccount, fold_horizon
from robustrl.contracts.ids import group_index
from robustrl.contracts.incidents import IncidentSubject, new_incident
from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.ledger import dropped_pages
from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.channels import open_channel
from robustrl.core.fences import FenceSet
from robustrl.core.interceptors import REPEAT_WINDOW_S, Repeats
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry
from robustrl.core.role_server import LEAVING_LABEL, PREPARED_LABEL
from robustrl.core.runtime import ServiceRuntime
from robustrl.generation.tasks import TaskItem, UnknownTaskError, get_task, load_dataset
from robustrl.v1 import coordinator_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.coordinator import jobs, recovery, work
from services.coordinator.coalesce import CoalescedWrites
from services.coordinator.executor import RecoveryExecutor
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.leadership import Leadership
from services.coordinator.provisioner import NoProvisioner, Provisioner
from services.coordinator.space import SpaceKeeper
from services.coordinator.store import JobStore

log = get_logger(__name__)

Action: TypeAlias = trainer_pb2.ControlRequest.Action.ValueType

MAX_REQUEST_ID = 128
"""The longest LeaseWork request_id taken (the ledger keeps each rollout's last one)."""
CONTROL_DEADLINE = 30.0
"""Seconds a member gets to accept a BIND (it loads the model before answering)."""

PREPARE_DEADLINE = 600.0
"""Seconds a standby gets to build a job's model ahead of need (PREPARE)."""

ASKED_FOR_S = 120.0
"""A replacement asked of the provisioner counts as coming for this long: it is not asked for
again meanwhile, by this leader or (the time is stored in etcd) the next one."""

ACCOUNTING_ONLY = frozenset({"step_started_at", "step_work_started_at", "step_ended_at"})
"""Progress metrics that feed ETTR and are not kept in the job record."""


def dataset_for(spec: JobSpec) -> list[TaskItem]:
    """The job's training items; InvalidArgument naming the field when they cannot be had."""
    if spec.task.dataset:
        try:
            items = load_dataset(spec.task.dataset)
        except OSError as exc:
            raise InvalidArgument(
                f"task.dataset: cannot read {spec.task.dataset}: {exc.strerror}"
            ) from exc
        except ValueError as exc:
            raise InvalidArgument(f"task.dataset: {exc}") from exc
        if not items:
            raise InvalidArgument(f"task.dataset: {spec.task.dataset} has no rows")
        return items
    try:
        task = get_task(spec.task.name)
    except UnknownTaskError as exc:
        raise InvalidArgument(f"task.name: {exc}") from exc
    size = max(1024, 2 * spec.trainer.steps * spec.trainer.groups_per_step)
    return task.generate(size, spec.seed)


class JobDriver:
    def __init__(
        self,
        runtime: ServiceRuntime,
        leadership: Leadership,
        *,
        tick_interval: float,
        lease_seconds: float,
        ledger_page_size: int = work.PAGE_SIZE,
        unreported_loss_after: float = 15.0,
        space: SpaceKeeper | None = None,
    ) -> None:
        """`space`: what gets etcd out of NOSPACE in the leader's rounds; None leaves it to a
        person."""
        self.runtime = runtime
        self.leadership = leadership
        self.tick_interval = tick_interval
        self.lease_seconds = lease_seconds
        self.ledger_page_size = ledger_page_size
        self.ledgers: dict[str, work.WorkLedger] = {}
        self.datasets: dict[str, list[TaskItem]] = {}
        self.specs: dict[str, JobSpec] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._ledger_writes: dict[str, tuple[work.WorkLedger, CoalescedWrites]] = {}
        """Per job, the ledger being written and its writer (`ledger_changed`)."""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.provisioner: Provisioner = NoProvisioner()
        self.executor = RecoveryExecutor(self)
        self.accounts: dict[str, EttrAccount] = {}
        """ETTR per job, saved at <prefix>/ettr/<job> on every step."""
        self.unreadable: dict[str, str] = {}
        """Job -> why its ledger in etcd could not be read at election (`_reload`)."""
        self.generated: dict[str, dict[str, tuple[float, float]]] = {}
        """job -> delivered group -> when it was generated, until it trains (then it counts)."""
        self._preparing: dict[str, tuple[str, asyncio.Task[None]]] = {}
        """Standby trainer -> the job a PREPARE sent to it is building (until it answers)."""
        self._provisioning: dict[tuple[str, str], list[float]] = {}
        """(job, role) -> when replacements were asked for and have not registered yet."""
        self.unreported_loss_after = unreported_loss_after
        self._missing: dict[tuple[str, str], float] = {}
        """(job, bound member) -> since when it is missing from the registry (`_unreported`)."""
        self.space = space
        self._undone = Repeats(REPEAT_WINDOW_S)
        """Which `coordinator.lease_undone` lines to write (one per member per window)."""
        self.fences: FenceSet | None = None
        """Every fence, followed by a watch from the first election on (`_free_for`)."""
        self._barred: dict[str, set[str]] = {}
        """Job -> free members not bound to it because their id was fenced from it (logged once)."""

    # ------------------------------------------------------------------ plumbing

    @property
    def store(self) -> JobStore:
        assert self.runtime.client is not None
        return JobStore(self.runtime.client, self.runtime.keys)

    @property
    def registry(self) -> Registry:
        assert self.runtime.registry is not None
        return self.runtime.registry

    def lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-driver")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *(task for _, task in self._preparing.values()))
        await self.executor.stop()
        if self.fences is not None:
            await self.fences.stop()
        for _, writes in self._ledger_writes.values():
            await writes.stop()

    async def on_elected(self) -> None:
        """Reload every job's ledger and ETTR account from etcd (a new leader trusts only
        etcd). Finished jobs too: one that ended just before a failover still gets settled."""
        self.ledgers.clear()
        self.unreadable.clear()
        self._provisioning.clear()
        records, _ = await self.store.list_all()
        for record, _ in records:
            await self._reload(record)
        log.info("coordinator.ledgers_reloaded", jobs=len(self.ledgers))
        if self.fences is None:
            assert self.runtime.client is not None
            self.fences = FenceSet(self.runtime.client, self.runtime.keys)
            self.fences.start()
        await asyncio.wait_for(self.fences.loaded.wait(), self.runtime.etcd_settings.timeout)
        self.executor.start()

    async def _reload(self, record: JobRecord) -> None:
        """Load one job's records. One this leader cannot read (a corrupt value, or one that a
        newer release wrote in a shape this one does not know) costs that job alone, never the
        election: a job whose ledger is unreadable is failed at the next tick, since nobody can
        tell which of its groups were trained; an unreadable ETTR account leaves the job
        running without one. Either value stays in etcd as it was, for a person to look at.
        When the job's replacements were last asked for is loaded too (`_provision`)."""
        assert self.runtime.client is not None
        job_id, keys = record.job_id, self.runtime.keys
        raw = await self.runtime.client.get(keys.work(job_id))
        if raw is not None:
            try:
                self.ledgers[job_id] = packed.load(work.WorkLedger, raw.value)
            except ValueError as exc:
                detail = " ".join(str(exc).split())  # pydantic's are several lines
                self.unreadable[job_id] = (
                    f"its work ledger at {keys.work(job_id).decode()} cannot be read, so which "
                    f"groups were trained is unknown: {detail[:300]}"
                )
                log.error("coordinator.ledger_unreadable", job=job_id, error=detail)
        raw = await self.runtime.client.get(keys.provisioning(job_id))
        if raw is not None:
            try:
                asks = json.loads(raw.value)
                for role, times in asks.items():
                    self._provisioning[(job_id, str(role))] = [float(t) for t in times]
            except (ValueError, TypeError, AttributeError) as exc:  # ask again: costs little
                log.warning("coordinator.asks_unreadable", job=job_id, error=repr(exc))
        raw = await self.runtime.client.get(keys.ettr(job_id))
        if raw is not None:
            try:
                self.accounts[job_id] = packed.load(EttrAccount, raw.value)
            except ValueError as exc:
                self.accounts.pop(job_id, None)
                log.error("coordinator.ettr_account_unreadable", job=job_id, error=str(exc))

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

    def spec(self, record: JobRecord) -> JobSpec:
        spec = self.specs.get(record.job_id)
        if spec is None:
            spec = self.specs[record.job_id] = JobSpec.model_validate(record.spec)
        return spec

    def _unsupervisable(self, record: JobRecord) -> str | None:
        """Why a live job cannot be supervised by this release, if it cannot: its stored spec
        no longer validates (a schema changed under a running job). Such a job is failed with
        why, instead of raising in every round for as long as it lasts."""
        try:
            self.spec(record)
        except ValidationError as exc:
            return (
                "its stored spec no longer validates against this coordinator's schema, so it "
                f"cannot be supervised: {str(exc)[:400]}"
            )
        return None

    def ledger(self, job_id: str) -> work.WorkLedger:
        ledger = self.ledgers.get(job_id)
        if ledger is None:
            raise FailedPrecondition(f"job {job_id} has no work ledger on this leader yet")
        return ledger

    async def save_ledger(self, ledger: work.WorkLedger) -> None:
        """Store the ledger as it is now (`ledger_changed`, awaited)."""
        await self.ledger_changed(ledger)

    def ledger_changed(self, ledger: work.WorkLedger) -> asyncio.Future[None]:
        """A change to the ledger was just made: the future resolves once a write that carries
        it has landed (or fails as that write did). Changes made while a write is in flight
        share the next write (coalesce.CoalescedWrites): await it after letting go of the
        job's lock, and other requests change the ledger meanwhile."""
        known = self._ledger_writes.get(ledger.job_id)
        if known is None or known[0] is not ledger:
            known = (ledger, CoalescedWrites(functools.partial(self._write_ledger, ledger)))
            self._ledger_writes[ledger.job_id] = known
        return known[1].changed()

    async def _write_ledger(self, ledger: work.WorkLedger) -> None:
        """Store the ledger; when it lists a page's worth of dropped groups and take-backs,
        move them to a page stored in the same write (the in-memory ledger lets go of them
        only once the write landed, and only of those: others may have come meanwhile)."""
        assert self.runtime.client is not None
        keys, tx = self.runtime.keys, self.runtime.client.transactions
        paged = work.page_out(ledger, self.ledger_page_size)
        stored = paged[0] if paged else ledger
        puts = [tx.put(keys.work(ledger.job_id), packed.dump(stored))]
        if paged:
            page_key = keys.dropped_page(ledger.job_id, ledger.pages)
            puts.append(tx.put(page_key, packed.dump(paged[1])))
        ok, _ = await self.runtime.client.transaction(
            compare=self.leadership.guard(), success=puts, failure=[]
        )
        if not ok:
            raise Aborted("lost leadership while saving the work ledger; retry")
        if paged:
            work.forget_paged(ledger, paged[1], stored.pages)
            log.info("coordinator.ledger_paged", job=ledger.job_id, page=stored.pages - 1)

    async def paged_out_drops(self, ledger: work.WorkLedger, groups: Iterable[str]) -> set[str]:
        """Those of `groups` that a page of the job's ledger lists as dropped. The pages are
        read only for ids the ledger alone would take for trained (none, on a normal step)."""
        candidates = work.trained_unless_paged(ledger, groups) if ledger.pages else []
        if not candidates:
            return set()
        assert self.runtime.client is not None
        pages = await dropped_pages(self.runtime.client, self.runtime.keys, ledger.job_id)
        return {g for g in candidates if any(g in page.discarded for page in pages)}

    async def save_account(self, job_id: str) -> None:
        account = self.accounts.get(job_id)
        if account is None:
            return
        assert self.runtime.client is not None
        await self.runtime.client.put(self.runtime.keys.ettr(job_id), packed.dump(account))

    async def update_job(
        self,
        job_id: str,
        change: dict[str, object],
        phase: Phase | None = None,
        message: str = "",
        *,
        read: tuple[JobRecord, int] | None = None,
    ) -> JobRecord:
        """Apply a change to the job record with compare-and-swap, retrying lost races.
        `read`: the record and revision the caller just read, tried first instead of a get."""
        for _ in range(5):
            record, revision = read if read is not None else await self.store.get(job_id)
            read = None
            updated = record.model_copy(update={**change, "updated_at": jobs.now()})
            if phase is not None and phase is not record.phase:
                updated = jobs.transition(updated, phase, message, jobs.now())
            try:
                await self.store.update(updated, revision, self.leadership.guard())
                return updated
            except Aborted:
                continue
        raise Aborted(f"job {job_id} kept changing under the coordinator; retry")

    # ------------------------------------------------------------------ supervision

    async def tick(self) -> None:
        if self.space is not None:
            try:
                await self.space.keep()  # first: under NOSPACE the rest cannot write
            except Exception as exc:
                log.warning("coordinator.etcd_space_check_failed", error=repr(exc))
        records, _ = await self.store.list_all()
        members, _ = await self.registry.list()
        for record, _ in records:
            try:
                async with self.lock(record.job_id):
                    await self._tick_job(record, members)
            except Exception as exc:  # one job's trouble must not hold up the others
                log.warning("coordinator.job_tick_failed", job=record.job_id, error=repr(exc))
        self._prepare_standbys([r for r, _ in records], members)

    async def _tick_job(self, record: JobRecord, members: list[MemberRecord]) -> None:
        unreadable = self.unreadable.get(record.job_id)
        if unreadable is None and record.phase not in jobs.TERMINAL:
            unreadable = self._unsupervisable(record)
        if unreadable is not None:
            if record.phase not in jobs.TERMINAL:
                await self.fail(record.job_id, unreadable)  # the next tick releases it
            self.unreadable.pop(record.job_id, None)
        elif record.phase is Phase.PENDING:
            await self._try_start(record, members)
        elif record.phase in (Phase.RUNNING, Phase.RECOVERING):
            await self._supervise(record, members)
        else:
            await self._release(record.job_id, members)

    def _prepare_standbys(self, records: list[JobRecord], members: list[MemberRecord]) -> None:
        """Have each free warm standby trainer build the model of a running job ahead (PREPARE),
        so that taking over after a trainer failure only restores a checkpoint. A standby
        prepared for a running job is left alone; the others go to the running job with the
        fewest prepared standbys. Sent in the background: a model load takes a while."""
        running = {r.job_id: r for r in records if r.phase in (Phase.RUNNING, Phase.RECOVERING)}
        if not running:
            return
        preparing = {name: job for name, (job, _) in self._preparing.items()}
        for member, job_id in standbys_to_prepare(list(running), members, preparing):
            self._start_prepare(member, running[job_id])

    def _start_prepare(self, member: MemberRecord, record: JobRecord) -> None:
        task = asyncio.create_task(self._prepare(member, record))
        self._preparing[member.instance_id] = (record.job_id, task)
        task.add_done_callback(functools.partial(self._prepared, member.instance_id))

    def _prepared(self, instance_id: str, _: asyncio.Task[None]) -> None:
        self._preparing.pop(instance_id, None)
        self.wake()  # a replacement waiting for it is bound now, not at the next tick

    async def _prepare(self, member: MemberRecord, record: JobRecord) -> None:
        try:
            await self.control(
                member,
                trainer_pb2.ControlRequest.ACTION_PREPARE,
                record.job_id,
                member.epoch,
                {"spec_json": json.dumps(record.spec)},
                timeout=PREPARE_DEADLINE,
            )
        except grpc.aio.AioRpcError as exc:  # busy, bound meanwhile or gone: the next tick sees
            log.info("coordinator.prepare_failed", member=member.instance_id, error=exc.details())

    def _free_for(self, job_id: str, members: list[MemberRecord]) -> dict[str, list[MemberRecord]]:
        """Free trainers and rollouts (`free_members`) that may be bound to job_id: not under an
        id fenced from it, by the same check the monitor answers beats with. A fence names an
        instance id, and one bound under a fenced id (a process restarted in place with a fixed
        INSTANCE_ID, or a job id used again after a delete, whose fences stay) would be told it
        is fenced at its first beat and leave."""
        assert self.fences is not None, "fences are followed from the first election on"
        candidates = {role: free_members(members, role) for role in ("trainer", "rollout")}
        barred = {
            m.instance_id
            for found in candidates.values()
            for m in found
            if self.fences.fences(m.instance_id, job_id)
        }
        for instance_id in barred - self._barred.get(job_id, set()):
            log.warning(
                "coordinator.fenced_member_not_bound",
                job_id=job_id,
                member=instance_id,
                why="a process under this id was fenced from the job; give each process its own"
                " INSTANCE_ID",
            )
        self._barred[job_id] = barred
        return {
            role: [m for m in found if m.instance_id not in barred]
            for role, found in candidates.items()
        }

    async def _try_start(self, record: JobRecord, members: list[MemberRecord]) -> None:
        spec = self.spec(record)
        need = spec.rollout.replicas
        free = self._free_for(record.job_id, members)
        # A job starts on a free trainer; standbys wait for a trainer to fail.
        trainers = [m for m in free["trainer"] if m.labels.get("standby") != "true"]
        rollouts = free["rollout"]
        if not trainers or len(rollouts) < need:
            waiting = (
                f"waiting for 1 free trainer and {need} free rollouts "
                f"(free now: {len(trainers)} trainers, {len(rollouts)} rollouts)"
            )
            if record.message != waiting:
                await self.update_job(record.job_id, {"message": waiting})
            return
        try:
            dataset = dataset_for(spec)
        except InvalidArgument as exc:
            await self.update_job(record.job_id, {}, Phase.FAILED, exc.message)
            return
        chosen = [trainers[0], *rollouts[:need]]
        bound: list[MemberRecord] = []
        for member in chosen:
            try:
                await self.control(
                    member,
                    trainer_pb2.ControlRequest.ACTION_BIND,
                    record.job_id,
                    FIRST_EPOCH,
                    {"spec_json": json.dumps(record.spec)},
                )
            except grpc.aio.AioRpcError as exc:
                message = f"{member.role} {member.instance_id} refused the job: {exc.details()}"
                log.warning("coordinator.bind_failed", job=record.job_id, reason=message)
                for done in bound:
                    await self.control_quietly(
                        done, trainer_pb2.ControlRequest.ACTION_RELEASE, record.job_id, FIRST_EPOCH
                    )
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    await self.update_job(record.job_id, {}, Phase.FAILED, message)
                return
            bound.append(member)
        ledger = work.WorkLedger(job_id=record.job_id)
        await self.save_ledger(ledger)
        self.accounts[record.job_id] = EttrAccount(started_at=time.time())
        await self.save_account(record.job_id)
        self.ledgers[record.job_id] = ledger
        self.datasets[record.job_id] = dataset
        await self.update_job(
            record.job_id,
            {
                "members": [m.instance_id for m in chosen],
                "member_roles": {m.instance_id: m.role for m in chosen},
                "epoch": FIRST_EPOCH,
            },
            Phase.RUNNING,
            "running",
        )
        log.info(
            "coordinator.job_started", job=record.job_id, members=[m.instance_id for m in chosen]
        )

    async def _supervise(self, record: JobRecord, members: list[MemberRecord]) -> None:
        ledger = self.ledgers.get(record.job_id)
        if ledger is None:
            return
        await self._fill(record, members)
        await self._unreported(record, members)
        alive = {m.instance_id for m in members if m.job_id == record.job_id}
        changed = work.expire(ledger, time.time())
        for holder in {held.instance_id for held in ledger.open.values()} - alive:
            changed += work.release_holder(ledger, holder, f"{holder} left the registry")
        changed += work.release_lost(ledger, alive)
        if changed:
            log.info("coordinator.groups_requeued", job=record.job_id, groups=len(changed))
            await self.save_ledger(ledger)

    def release_lost_holder(
        self, record: JobRecord, ledger: work.WorkLedger, holder: str, reason: str
    ) -> list[str]:
        """Take back what a lost rollout held (work.release_lost_holder): the groups requeued
        or, a poison group, dropped (logged). Mutates the ledger; the caller saves it."""
        limit = self.spec(record).recovery.group_losses
        requeued, dropped = work.release_lost_holder(ledger, holder, reason, limit)
        for group in dropped:
            log.error(
                "coordinator.group_poisoned",
                job=record.job_id,
                group=group,
                holder=holder,
                losses=limit,
                then="dropped, not leased again",
            )
        return requeued + dropped

    def poison_verdict(self, record: JobRecord, ledger: work.WorkLedger) -> str:
        """Why the job fails, once `recovery.poison_groups` of its groups were dropped as
        poison groups; empty until then (and always, with no limit)."""
        policy = self.spec(record).recovery
        if not policy.poison_groups or ledger.poisoned < policy.poison_groups:
            return ""
        return (
            f"{ledger.poisoned} prompt groups were dropped as poison groups (each took down "
            f"{policy.group_losses} rollouts that generated it; recovery.poison_groups is "
            f"{policy.poison_groups}): what takes down the rollouts is the job's own "
            "(its model, engine or data), not a machine's; `robustrl dropped "
            f"{record.job_id}` lists them"
        )

    async def _trainer_error(
        self, record: JobRecord, request: coordinator_pb2.ReportProgressRequest
    ) -> None:
        """The trainer stopped on an error and said so. An error in the job itself fails it.
        Any other, the first time at a step, is recorded as a TRAINER_ERROR incident and
        recovered as a lost trainer (another trainer restores the last checkpoint); the same
        error again before any progress fails the job (recovery.trainer_error_recovered).
        A report sent again changes nothing."""
        message = f"trainer {request.instance_id}: {request.error}"
        if request.error_in_job:
            await self.fail(record.job_id, message)
            return
        earlier, _ = await self.executor.incident_log.list(record.job_id, kind="TRAINER_ERROR")
        if any(i.instance_id == request.instance_id and i.epoch == record.epoch for i in earlier):
            return  # recorded already: the trainer sent its report again
        if not recovery.trainer_error_recovered(request.step, [i.step for i in earlier]):
            before = max(i.step for i in earlier)
            message += (
                f" (at step {request.step}, after a trainer that stopped at step {before} was "
                "replaced: the error is the job's, not a machine's)"
            )
            await self.fail(record.job_id, message)
            return
        await self._record_incident(
            record,
            request.instance_id,
            "TRAINER_ERROR",
            f"stopped at step {request.step} on an error: {request.error}",
            confidence=1.0,
            step=request.step,
        )
        log.warning(
            "coordinator.trainer_error",
            job=record.job_id,
            member=request.instance_id,
            step=request.step,
            error=request.error,
        )

    async def _record_incident(
        self,
        record: JobRecord,
        instance_id: str,
        kind: str,
        evidence: str,
        *,
        confidence: float,
        step: int = 0,
    ) -> None:
        """An incident the leader found itself (not the monitor), about a member of `record`,
        recorded where the monitor's go: the executor recovers it as any other."""
        subject = IncidentSubject(
            role=record.member_roles.get(instance_id, "trainer"),
            instance_id=instance_id,
            epoch=record.epoch,
            job_id=record.job_id,
        )
        incident = new_incident(subject, kind, evidence, confidence, time.time(), step=step)
        await self.executor.incident_log.record(incident)

    async def fail(
        self, job_id: str, message: str, changes: dict[str, object] | None = None
    ) -> None:
        """End the job as FAILED with `message`, applying `changes` to its record too."""
        await self.update_job(job_id, changes or {}, Phase.FAILED, message)
        log.warning("coordinator.job_failed", job=job_id, reason=message)

    async def _unreported(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """Record the loss of a bound member that has been missing from the registry for
        `unreported_loss_after` seconds. The monitor reports a loss within the session TTL,
        and recovery then unbinds the member; a member still bound and missing after that
        failed while no monitor ran (a monitor that restarts lists only the registered
        members: it never saw it go). Once recorded, the incident is recovered as any other
        (its recovery unbinds the member, so it is recorded once)."""
        now = time.time()
        for instance_id, since in missing_members(record, members, self._missing, now):
            if now - since < self.unreported_loss_after:
                continue
            role = record.member_roles[instance_id]
            other = next((m for m in members if m.instance_id == instance_id), None)
            where = (
                "missing from the registry"
                if other is None
                else f"registered again as a member of {other.job_id or 'no job'} (a new process)"
            )
            await self._record_incident(
                record,
                instance_id,
                "MEMBER_LOST",
                f"bound to job {record.job_id} but {where} for {now - since:.0f}s, "
                "and no monitor reported it",
                confidence=0.9,
            )
            self._missing[(record.job_id, instance_id)] = now  # once per grace, at most
            log.warning(
                "coordinator.unreported_loss", job=record.job_id, member=instance_id, role=role
            )

    async def _fill(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """Bind replacements for roles the job lost (recovery fenced them): a free member if
        there is one, else ask the provisioner. A new trainer comes with a new epoch.

        Only a member prepared for this job (label prepared=<job>) is bound. Any other is sent
        PREPARE first, in the background, and bound once it answers (the answer wakes the
        next round): a BIND that builds a model would hold this job's lock for seconds, and
        with it every lease, delivery and progress report of the job's living members."""
        if record.members and not record.member_roles:
            return  # a record from before roles were kept: nothing to compare with
        spec = self.spec(record)
        roles = list(record.member_roles.values())
        missing = (["trainer"] if "trainer" not in roles else []) + ["rollout"] * max(
            0, spec.rollout.replicas - roles.count("rollout")
        )
        if not missing:
            return
        epoch = record.epoch + 1 if "trainer" in missing else record.epoch
        candidates = self._free_for(record.job_id, members)
        free = {  # those prepared for this job first, then warm standbys
            role: sorted(
                candidates[role],
                key=lambda m: (
                    m.labels.get(PREPARED_LABEL) != record.job_id,
                    m.labels.get("standby") != "true",
                ),
            )
            for role in ("trainer", "rollout")
        }
        shortfall = Counter(missing)
        bound: list[MemberRecord] = []
        for role in list(shortfall):
            while shortfall[role] and free[role]:
                member = free[role].pop(0)
                if member.labels.get(PREPARED_LABEL) != record.job_id:
                    preparing = self._preparing.get(member.instance_id)
                    if preparing is None:
                        self._start_prepare(member, record)
                    elif preparing[0] != record.job_id:
                        continue  # busy building another job's model
                    shortfall[role] -= 1  # it will be bound when prepared
                    continue
                try:
                    await self.control(
                        member,
                        trainer_pb2.ControlRequest.ACTION_BIND,
                        record.job_id,
                        epoch,
                        {"spec_json": json.dumps(record.spec)},
                    )
                except grpc.aio.AioRpcError as exc:  # fenced, busy or gone: try the next one
                    log.info(
                        "coordinator.bind_failed", member=member.instance_id, error=exc.details()
                    )
                    continue
                bound.append(member)
                shortfall[role] -= 1
        for role, short in shortfall.items():
            if short:
                await self._provision(record.job_id, role, short)
            elif self._provisioning.pop((record.job_id, role), None):
                await self._save_asks(record.job_id)
        if not bound:
            return
        for member in bound:
            if member.labels.get("standby") == "true":
                # Keep one warm: the next trainer failure should not wait for a cold start.
                try:
                    await self.provisioner.request(
                        "trainer", record.job_id, f"replacing standby {member.instance_id}", True
                    )
                except Exception as exc:
                    log.error("coordinator.provision_failed", role="standby", error=repr(exc))
        new_roles = {**record.member_roles, **{m.instance_id: m.role for m in bound}}
        recovered = "trainer" in new_roles.values() and record.phase is Phase.RECOVERING
        await self.update_job(
            record.job_id,
            {
                "members": [*record.members, *(m.instance_id for m in bound)],
                "member_roles": new_roles,
                "epoch": epoch,
                # A restored trainer starts from its checkpoint's version, which may be lower
                # than the last one reported: rollouts must not wait for the lost versions.
                **({"weight_version": 0} if epoch > record.epoch else {}),
            },
            Phase.RUNNING if recovered else None,
            "running (recovered)" if recovered else record.message,
        )
        for member in bound:
            log.warning(
                "coordinator.replacement_bound",
                job=record.job_id,
                member=member.instance_id,
                role=member.role,
                epoch=epoch,
            )
            await self.executor.bound(record.job_id, member.role, member.instance_id)

    def provision_failed(self, job_id: str, role: str) -> None:
        """The provisioner will not deliver a member it was asked for: the next supervision
        round asks again instead of waiting out the de-duplication window."""
        asked = self._provisioning.get((job_id, role))
        if asked:
            asked.pop(0)

    async def _provision(self, job_id: str, role: str, count: int) -> None:
        """Ask for `count` members of `role`, minus those asked for recently (ASKED_FOR_S).
        When is stored in etcd: a leader elected while they start must not ask again."""
        now = time.time()
        earlier = self._provisioning.get((job_id, role), [])
        asked = self._provisioning[(job_id, role)] = [t for t in earlier if now - t < ASKED_FOR_S]
        try:
            for _ in range(count - len(asked)):
                try:
                    await self.provisioner.request(role, job_id, f"replacement for job {job_id}")
                except Exception as exc:
                    log.error(
                        "coordinator.provision_failed", role=role, job=job_id, error=repr(exc)
                    )
                    return
                asked.append(now)
        finally:
            if asked != earlier:
                await self._save_asks(job_id)

    async def _save_asks(self, job_id: str) -> None:
        """Store when this job's replacements were asked for (deleted once none is awaited).
        A write that fails costs only a second ask after a failover: logged, not raised."""
        client = self.runtime.client
        assert client is not None
        key, tx = self.runtime.keys.provisioning(job_id), client.transactions
        asks = {role: times for (job, role), times in self._provisioning.items() if job == job_id}
        write = tx.put(key, json.dumps(asks).encode()) if any(asks.values()) else tx.delete(key)
        try:
            ok, _ = await client.transaction(
                compare=self.leadership.guard(), success=[write], failure=[]
            )
        except Exception as exc:
            log.warning("coordinator.asks_not_stored", job=job_id, error=repr(exc))
            return
        if not ok:
            log.warning("coordinator.asks_not_stored", job=job_id, error="lost leadership")

    async def _release(self, job_id: str, members: list[MemberRecord]) -> None:
        ledger = self.ledgers.get(job_id)
        if ledger is not None:
            record, _ = await self.store.get(job_id)
            left = work.settle_leftovers(ledger, f"job {record.phase.value.lower()} first")
            if left:
                await self.save_ledger(ledger)
        for member in members:
            # Follower ranks are started and stopped by their rank 0, not bound by us.
            if member.job_id == job_id and member.labels.get("follower") != "true":
                await self.control_quietly(
                    member, trainer_pb2.ControlRequest.ACTION_RELEASE, job_id, member.epoch
                )
        account = self.accounts.get(job_id)
        if account is not None and account.ended_at is None:
            account.end(time.time())
            await self.save_account(job_id)
        awaited = any(job == job_id for job, _ in self._provisioning)
        self._forget(job_id)
        if awaited:
            await self._save_asks(job_id)  # none now: deletes the stored asks

    def _forget(self, job_id: str) -> None:
        """Drop what this leader keeps in memory for a job that has ended (its records stay
        in etcd): a leader that runs for months must not grow with every job it ran."""
        for table in (self.ledgers, self.accounts, self.generated, self.datasets):
            table.pop(job_id, None)
        self._ledger_writes.pop(job_id, None)
        self._barred.pop(job_id, None)
        for keyed in (self._missing, self._provisioning):
            for key in [k for k in keyed if k[0] == job_id]:
                del keyed[key]

    async def control(
        self,
        member: MemberRecord,
        action: Action,
        job_id: str,
        epoch: int,
        args: dict[str, str] | None = None,
        *,
        timeout: float = CONTROL_DEADLINE,
    ) -> None:
        request = trainer_pb2.ControlRequest(
            action=action,
            job_id=job_id,
            epoch=epoch,
            args=args or {},
        )
        async with open_channel(member.address) as channel:
            if member.role == "trainer":
                await trainer_pb2_grpc.TrainerStub(channel).Control(request, timeout=timeout)
            else:
                await rollout_pb2_grpc.RolloutStub(channel).Control(request, timeout=timeout)

    async def control_quietly(
        self,
        member: MemberRecord,
        action: Action,
        job_id: str,
        epoch: int,
        args: dict[str, str] | None = None,
    ) -> None:
        try:
            await self.control(member, action, job_id, epoch, args)
        except grpc.aio.AioRpcError as exc:
            log.info("coordinator.control_failed", member=member.instance_id, error=exc.details())

    # ------------------------------------------------------------------ data-plane RPCs

    async def _bound_member(self, record: JobRecord, role: str, instance_id: str) -> MemberRecord:
        if record.member_roles and instance_id not in record.member_roles:
            raise FailedPrecondition(
                f"{role} {instance_id} no longer serves job {record.job_id} (fenced or replaced)"
            )
        member = await self.registry.get(role, instance_id)
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

    async def delete_job(self, job_id: str, guard: list[object]) -> int:
        """Remove an ended job's state from etcd (JobStore.delete); return the keys deleted.
        Members still bound to the job are released first (as the supervision round would);
        FailedPrecondition while the job has not ended or a member could not be released."""
        async with self.lock(job_id):
            record, revision = await self.store.get(job_id)
            if record.phase not in jobs.TERMINAL:
                raise FailedPrecondition(
                    f"job {job_id!r} is {record.phase.value}; cancel it before deleting it"
                )
            members, _ = await self.registry.list()
            if any(m.job_id == job_id for m in members):
                await self._release(job_id, members)
                members, _ = await self.registry.list()
            bound = sorted(m.instance_id for m in members if m.job_id == job_id)
            if bound:
                raise FailedPrecondition(
                    f"job {job_id!r} still has members bound to it that did not answer a "
                    f"release ({', '.join(bound)}); retry once they are released or gone"
                )
            deleted = await self.store.delete(job_id, revision, guard)
            self._forget(job_id)
        log.info("coordinator.job_deleted", job=job_id, keys=deleted)
        return deleted

    async def lease_work(
        self, request: coordinator_pb2.LeaseWorkRequest
    ) -> coordinator_pb2.LeaseWorkResponse:
        if request.max_groups < 1:
            raise InvalidArgument("max_groups must be >= 1")
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID} characters")
        saved: asyncio.Future[None] | None = None
        async with self.lock(request.job_id):
            record, _ = await self.store.get(request.job_id)
            if record.phase in jobs.TERMINAL:
                return coordinator_pb2.LeaseWorkResponse(job_done=True)
            # RECOVERING too: rollouts keep generating while a trainer is restored.
            running = record.phase in (Phase.RUNNING, Phase.RECOVERING)
            if not running or request.job_id not in self.ledgers:
                return coordinator_pb2.LeaseWorkResponse(retry_after_s=0.5)
            await self._bound_member(record, "rollout", request.instance_id)
            spec = self.spec(record)
            ledger = self.ledger(request.job_id)
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
                saved = self.ledger_changed(ledger)
            dataset = self.datasets.get(request.job_id) or dataset_for(spec)
            self.datasets[request.job_id] = dataset
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
        async with self.lock(job_id):
            ledger = self.ledgers.get(job_id)
            if ledger is None or not (back := work.unlease(ledger, instance_id, granted)):
                return
            # The next write carries it; nobody waits for that one.
            self.ledger_changed(ledger).add_done_callback(_retrieve)
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
        async with self.lock(request.job_id):
            record, _ = await self.store.get(request.job_id)
            if record.phase in jobs.TERMINAL:
                return
            await self._bound_member(record, "rollout", request.instance_id)
            if request.error:
                await self.fail(request.job_id, f"rollout {request.instance_id}: {request.error}")
                return
            ledger = self.ledger(request.job_id)
            ignored = work.complete(ledger, request.instance_id, list(request.group_ids))
            ignored += work.give_back(ledger, request.instance_id, dict(request.returned))
            if request.generated_to > request.generated_from > 0:
                spans = self.generated.setdefault(request.job_id, {})
                for group in set(request.group_ids) - set(ignored):
                    spans[group] = (request.generated_from, request.generated_to)
            if ignored:
                log.debug(
                    "coordinator.completion_ignored",
                    job=request.job_id,
                    member=request.instance_id,
                    groups=ignored,
                )
            saved = self.ledger_changed(ledger)
        await saved  # outside the lock, as in lease_work

    async def report_progress(self, request: coordinator_pb2.ReportProgressRequest) -> bool:
        async with self.lock(request.job_id):
            read = await self.store.get(request.job_id)
            record = read[0]
            if record.phase in jobs.TERMINAL:
                return False
            await self._bound_member(record, "trainer", request.instance_id)
            if request.error:
                await self._trainer_error(record, request)
                return False
            ledger = self.ledgers.get(request.job_id)
            if ledger is not None:
                discarded = dict(request.discarded_groups)
                ignored = work.record_progress(
                    ledger,
                    list(request.trained_group_ids),
                    discarded,
                    await self.paged_out_drops(ledger, discarded),
                    step=request.step,
                    durable=request.durable_step,
                    restored=request.restored_step,
                )
                if ignored:
                    # Already settled (a report sent again) or never leased: counted once.
                    log.info("coordinator.progress_ignored", job=request.job_id, groups=ignored)
                regenerate = dict(request.regenerate_groups)
                paged_out = await self.paged_out_drops(ledger, regenerate)
                again = work.regenerate(ledger, regenerate, paged_out)
                if again:
                    log.info("coordinator.groups_requeued", job=request.job_id, groups=again)
                await self.save_ledger(ledger)
            self._account_progress(ledger, request)
            change: dict[str, object] = {
                "step": request.step,
                "weight_version": request.weight_version,
                "metrics": {
                    **record.metrics,
                    **{k: v for k, v in request.metrics.items() if k not in ACCOUNTING_ONLY},
                },
            }
            if request.finished:
                spec = self.spec(record)
                await self.update_job(
                    request.job_id,
                    change,
                    Phase.SUCCEEDED,
                    f"completed {request.step}/{spec.trainer.steps} steps",
                    read=read,
                )
                log.info("coordinator.job_succeeded", job=request.job_id, step=request.step)
                await self.save_account(request.job_id)
                return False
            await self.update_job(request.job_id, change, read=read)
            await self.save_account(request.job_id)
            return True

    def _account_progress(
        self, ledger: work.WorkLedger | None, request: coordinator_pb2.ReportProgressRequest
    ) -> None:
        """ETTR: the step is kept time (until a roll back takes it; its wait for data within a
        bound), and so is the generation of every group it trained."""
        account = self.accounts.get(request.job_id)
        if account is None:
            return
        now = time.time()
        started = request.metrics.get("step_started_at", 0.0)
        ended = request.metrics.get("step_ended_at", 0.0)
        if request.step > 0 and ended > started > 0:
            done = [s.step for s in account.steps]
            if done and request.step <= max(done):
                # A restored trainer computes these steps again: the first tries are lost.
                with contextlib.suppress(ValueError):
                    account.roll_back(request.step - 1)
            work = request.metrics.get("step_work_started_at")
            account.add_step(request.step, started, ended, work_start=work)
        spans = self.generated.get(request.job_id, {})
        for group in request.trained_group_ids:
            span = spans.pop(group, None)
            if span is not None:
                account.add_generation(*span)
        for group in [*request.discarded_groups, *request.regenerate_groups]:
            spans.pop(group, None)
        if request.finished:
            account.end(now)
        horizon = fold_horizon(
            now,
            (start for start, _ in spans.values()),
            (lease.deadline for lease in ledger.open.values()) if ledger else (),
            self.lease_seconds,
        )
        with contextlib.suppress(ValueError):
            # Steps after the trainer's durable checkpoint may still be rolled back.
            account.compact(horizon, checkpoint_step=max(0, request.durable_step))


def _retrieve(done: asyncio.Future[None]) -> None:
    """Take a future's outcome so that a failure nobody awaits is not logged as unretrieved."""
    if not done.cancelled():
        done.exception()


def missing_members(
    record: JobRecord,
    members: list[MemberRecord],
    missing: dict[tuple[str, str], float],
    now: float,
) -> list[tuple[str, float]]:
    """The job's bound members missing from the registry, each with since when (kept in
    `missing`, which forgets a member once it is registered again or no longer bound).

    Registered means registered as a member of this job: a record under the same name but of no
    job or another is a new process that took the name (the whole local stack stopped and
    started again, a pod replaced under a fixed name), and the job's member is as gone as if
    nothing were there."""
    registered = {m.instance_id for m in members if m.job_id == record.job_id}
    bound = {(record.job_id, i) for i in record.member_roles if i not in registered}
    for key in [k for k in missing if k[0] == record.job_id and k not in bound]:
        del missing[key]
    for key in bound:
        missing.setdefault(key, now)
    return sorted((i, missing[(job, i)]) for job, i in bound)


def standbys_to_prepare(
    running: list[str], members: list[MemberRecord], preparing: dict[str, str]
) -> list[tuple[MemberRecord, str]]:
    """(free standby trainer, running job) pairs to send PREPARE to. A standby prepared for a
    running job (label), or with a PREPARE under way (`preparing`: instance -> job), is left
    alone; each of the others goes to the running job with the fewest standbys so far."""
    if not running:
        return []
    standbys = [m for m in free_members(members, "trainer") if m.labels.get("standby") == "true"]
    served = Counter({job: 0 for job in running})
    served.update(m.labels.get(PREPARED_LABEL, "") for m in standbys)
    served.update(preparing.values())
    chosen = []
    for member in standbys:
        if member.labels.get(PREPARED_LABEL) in running or member.instance_id in preparing:
            continue
        job_id = min(running, key=lambda j: served[j])
        served[job_id] += 1
        chosen.append((member, job_id))
    return chosen


def free_members(members: list[MemberRecord], role: str) -> list[MemberRecord]:
    """Members of `role` that a job may bind: in no job, not a trainer's follower rank, not
    fenced, not about to exit."""
    return [
        m
        for m in members
        if m.role == role
        and not m.job_id
        and m.labels.get("follower") != "true"
        and m.labels.get("fenced") != "true"
        and m.labels.get(LEAVING_LABEL) != "true"
    ]
