"""The recovery executor: the leader turns incidents into the policy's actions
(`policy.decide`), carries them out, and records each recovery in etcd
(`<prefix>/recovery/<job>/<incident id>`), where `robustrl status` reads it.

It follows the incident log the monitor (and the leader itself) writes. A new leader lists the
log again, and an incident that already has a recovery record is never acted on twice.
Replacements are bound by the supervision round (binding.py: a free member, else one the
provisioner starts); the record is closed when the replacement serves the job (`bound`).
What the executor needs from the rest of the coordinator is `Coordinator`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import aetcd
import grpc
from pydantic import BaseModel, Field

from robustrl.contracts.errors import NotFound
from robustrl.contracts.ettr import IncidentTiming
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.ledger import WorkLedger
from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.fences import FenceRecord, withdraw_holder_records, write_fence
from robustrl.core.incident_log import IncidentLog
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry
from robustrl.core.role_server import EXIT_ARG
from robustrl.core.runtime import ServiceRuntime
from services.coordinator import policy, work
from services.coordinator.control import FENCE, RELEASE, control, control_quietly
from services.coordinator.jobs import TERMINAL, JobRecord, Phase
from services.coordinator.policy import Do

log = get_logger(__name__)

FENCE_DEADLINE = 2.0
"""Seconds a fenced member gets to hear it; one that is stopped or dead is fenced in etcd."""


class RecoveryRecord(BaseModel):
    incident_id: str
    job_id: str
    kind: str
    role: str
    instance_id: str
    rank: int = 0
    detected_at: float
    started_at: float
    actions: list[str] = Field(default_factory=list)
    waiting_for: list[str] = Field(default_factory=list)
    """Roles still to be bound to the job (a replacement rollout, a restored trainer)."""
    replacements: list[str] = Field(default_factory=list)
    done_at: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.detected_at


class Coordinator(Protocol):
    """What recovery needs from the rest of the coordinator (the JobDriver provides it)."""

    @property
    def is_leader(self) -> bool: ...

    def lock(self, job_id: str) -> asyncio.Lock:
        """The job's lock: every change to a job's state is made under it."""
        ...

    async def job(self, job_id: str) -> JobRecord:
        """The job's record as stored; NotFound if there is none."""
        ...

    def spec(self, record: JobRecord) -> JobSpec: ...

    def ledger_of(self, job_id: str) -> WorkLedger | None:
        """The job's work ledger on this leader, None if it has none."""
        ...

    async def save_ledger(self, ledger: WorkLedger) -> None: ...

    async def update_job(
        self,
        job_id: str,
        change: dict[str, object],
        phase: Phase | None = None,
        message: str = "",
    ) -> JobRecord:
        """Apply a change (and a phase, with its message) to the job record."""
        ...

    async def fail(
        self, job_id: str, message: str, changes: dict[str, object] | None = None
    ) -> None: ...

    async def account_incident(self, job_id: str, timing: IncidentTiming) -> None:
        """The incident's timeline in the job's ETTR account."""
        ...

    def wake(self) -> None:
        """Supervise now: a recovery left a role to fill."""
        ...

    async def free_member_lost(self, incident: IncidentRecord) -> None:
        """An incident about a member in no job (a standby prepared for one is replaced)."""
        ...


class RecoveryExecutor:
    def __init__(self, runtime: ServiceRuntime, coordinator: Coordinator) -> None:
        self.runtime = runtime
        self.coordinator = coordinator
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def incident_log(self) -> IncidentLog:
        assert self.runtime.client is not None
        return IncidentLog(self.runtime.client, self.runtime.keys)

    def start(self) -> None:
        """Called on election: (re)read the incident log from the start and follow it."""
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._follow(), name="recovery")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._background)

    async def _follow(self) -> None:
        records, revision = await self.incident_log.list()
        for incident in records:
            await self._handle_quietly(incident)
        async for incident in self.incident_log.follow("", revision):
            await self._handle_quietly(incident)

    async def _handle_quietly(self, incident: IncidentRecord) -> None:
        if not self.coordinator.is_leader:
            return
        try:
            if incident.job_id:
                await self.handle(incident)
            else:
                await self.coordinator.free_member_lost(incident)
        except Exception as exc:  # one failed recovery must not stop the follower
            log.error("recovery.failed", incident=incident.incident_id, exc_info=exc)

    async def handle(self, incident: IncidentRecord) -> None:
        coordinator = self.coordinator
        client, keys = self.runtime.client, self.runtime.keys
        assert client is not None
        async with coordinator.lock(incident.job_id):
            if await client.get(keys.recovery(incident.job_id, incident.incident_id)):
                return  # acted on already (by this leader or an earlier one)
            try:
                record = await coordinator.job(incident.job_id)
            except NotFound:
                return
            if record.phase in TERMINAL:
                return
            spec = coordinator.spec(record)
            # Only the NaN policy looks at earlier NaN incidents: no log read for the others.
            nan_history = await self._nan_history(incident) if incident.kind == "NON_FINITE" else []
            registered, _ = await self._registry().list()
            decided = policy.decide(
                policy.incident_facts(record, incident),
                policy.facts(record, spec.recovery.mode, nan_history, registered),
            )
            if not decided:
                return
            entry = RecoveryRecord(
                incident_id=incident.incident_id,
                job_id=incident.job_id,
                kind=incident.kind,
                role=incident.role,
                instance_id=incident.instance_id,
                rank=incident.rank,
                detected_at=incident.detected_at,
                started_at=time.time(),
                actions=[f"{a.do.value} {a.instance_id}".strip() for a in decided],
            )
            log.warning(
                "recovery.started",
                job=incident.job_id,
                incident=incident.incident_id,
                kind=incident.kind,
                member=incident.instance_id,
                actions=entry.actions,
            )
            await self._save(entry)
            await self._execute(record, spec, decided, entry)
            await self._save(entry)
            await self._account(entry)
        if entry.waiting_for:
            coordinator.wake()  # bind the replacement now, not at the next tick

    async def _execute(
        self,
        record: JobRecord,
        spec: JobSpec,
        actions: list[policy.Action],
        entry: RecoveryRecord,
    ) -> None:
        coordinator = self.coordinator
        roles = dict(record.member_roles)
        fenced: list[str] = []
        phase: Phase | None = None
        failure = ""  # the job's own fault: it fails, with this message
        for action in actions:
            if action.do is Do.FENCE:
                await self._fence(record, action.instance_id, action.reason)
                fenced.append(action.instance_id)
            elif action.do is Do.REQUEUE:
                ledger = coordinator.ledger_of(record.job_id)
                if ledger is not None:
                    taken = self._release_lost_holder(record, spec, ledger, action)
                    await coordinator.save_ledger(ledger)
                    log.info("recovery.requeued", job=record.job_id, groups=len(taken))
                    failure = policy.poison_verdict(record.job_id, spec.recovery, ledger.poisoned)
                    if failure:
                        break  # the job fails: nothing is replaced
            elif action.do is Do.REPLACE_ROLLOUT:
                entry.waiting_for.append("rollout")
            elif action.do is Do.RESTORE_TRAINER:
                entry.waiting_for.append("trainer")
                phase = Phase.RECOVERING
                ledger = coordinator.ledger_of(record.job_id)
                if ledger is not None:
                    work.trainer_replaced(ledger)
                    await coordinator.save_ledger(ledger)
            elif action.do is Do.ROLLBACK:
                # The trainer skipped the poisoned step (no optimizer update, weights and
                # optimizer state untouched): the rollback to the last good state is done.
                entry.done_at = time.time()
            elif action.do is Do.FULL_RESTART:
                await self._full_restart(record, action.reason, entry)
                return
        members = [m for m in record.members if m not in fenced]
        ranks = {m: r for m, r in record.member_ranks.items() if m not in fenced}
        for gone in fenced:
            roles.pop(gone, None)
        change: dict[str, object] = {
            "members": members,
            "member_roles": roles,
            "member_ranks": ranks,
        }
        if failure:
            await coordinator.fail(record.job_id, failure, change)
            return
        message = f"recovering from {entry.kind} of {entry.instance_id}"
        await coordinator.update_job(
            record.job_id,
            change,
            phase,
            message if phase else record.message,
        )

    @staticmethod
    def _release_lost_holder(
        record: JobRecord, spec: JobSpec, ledger: WorkLedger, action: policy.Action
    ) -> list[str]:
        """Take back what a lost rollout held (work.release_lost_holder): the groups requeued
        or, a poison group, dropped (logged). Mutates the ledger; the caller saves it."""
        limit = spec.recovery.group_losses
        holder = action.instance_id
        requeued, dropped = work.release_lost_holder(ledger, holder, action.reason, limit)
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

    async def _full_restart(self, record: JobRecord, reason: str, entry: RecoveryRecord) -> None:
        """The baseline: every role restarts as a new process and the job resumes from the last
        checkpoint. The failed member is fenced; every other member of the job is released and
        exits, so its replacement pays a process start-up and a model load, as a restart does.
        Replacements are bound as after any failure: a prepared warm standby trainer if there
        is one, else members the provisioner starts."""
        coordinator = self.coordinator
        await self._fence(record, entry.instance_id, reason)
        members, _ = await self._registry().list()
        for member in members:
            if (
                member.instance_id in record.member_roles
                and member.instance_id != entry.instance_id
            ):
                await control_quietly(
                    member, RELEASE, record.job_id, record.epoch, {EXIT_ARG: "true"}
                )
        ledger = coordinator.ledger_of(record.job_id)
        if ledger is not None:
            # Open leases and delivered-but-untrained groups alike lived in roles that are
            # thrown away (the rollouts' memory, the trainer's intake): generate them again.
            for group in [*ledger.open, *ledger.delivered]:
                work.take_back(ledger, group, f"full restart ({reason})")
            # So are the rollouts that held the groups of steps after the last checkpoint: the
            # new trainer's first report hands them back (work.release_lost).
            work.trainer_replaced(ledger)
            await coordinator.save_ledger(ledger)
        entry.waiting_for = list(record.member_roles.values())
        await coordinator.update_job(
            record.job_id,
            {"members": [], "member_roles": {}, "member_ranks": {}},
            Phase.RECOVERING,
            f"full restart after {entry.kind} of {entry.instance_id}",
        )

    async def _fence(self, record: JobRecord, instance_id: str, reason: str) -> None:
        role = record.member_roles.get(instance_id, "trainer")
        await self.fence(record.job_id, record.epoch, role, instance_id, reason)

    async def fence(
        self, job_id: str, epoch: int, role: str, instance_id: str, reason: str
    ) -> None:
        """Fence the instance from the job at `epoch`: the fence record, its weight-holder
        records withdrawn, and the member told (in the background: it may be stopped)."""
        client, keys = self.runtime.client, self.runtime.keys
        assert client is not None
        await write_fence(
            client,
            keys,
            FenceRecord(instance_id=instance_id, job_id=job_id, epoch=epoch, reason=reason[:500]),
        )
        withdrawn = await withdraw_holder_records(client, keys, job_id, instance_id)
        log.warning(
            "recovery.fenced",
            job=job_id,
            member=instance_id,
            role=role,
            reason=reason,
            holder_records=withdrawn,
        )
        member = await self._registry().get(role, instance_id)
        if member is not None:
            task = asyncio.create_task(self._tell_fenced(member, job_id, epoch))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _tell_fenced(self, member: MemberRecord, job_id: str, epoch: int) -> None:
        try:
            await asyncio.wait_for(control(member, FENCE, job_id, epoch), FENCE_DEADLINE)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.info("recovery.fence_unheard", member=member.instance_id, error=repr(exc)[:200])

    async def _nan_history(self, incident: IncidentRecord) -> list[int]:
        """Ranks of the job's earlier NaN incidents, oldest first (this one left out)."""
        records, _ = await self.incident_log.list(incident.job_id, kind="NON_FINITE")
        return [r.rank for r in records if r.incident_id != incident.incident_id]

    async def _account(self, entry: RecoveryRecord) -> None:
        """The incident's timeline in the job's ETTR account."""
        await self.coordinator.account_incident(
            entry.job_id,
            IncidentTiming(
                incident_id=entry.incident_id,
                kind=entry.kind,
                role=entry.role,
                instance_id=entry.instance_id,
                detected_at=entry.detected_at,
                recovered_at=entry.done_at,
            ),
        )

    async def _save(self, entry: RecoveryRecord) -> None:
        assert self.runtime.client is not None
        await self.runtime.client.put(
            self.runtime.keys.recovery(entry.job_id, entry.incident_id),
            entry.model_dump_json().encode(),
        )

    def _registry(self) -> Registry:
        assert self.runtime.registry is not None
        return self.runtime.registry

    async def bound(self, job_id: str, role: str, instance_id: str) -> None:
        """`instance_id` was bound as `role` to the job: close the recovery that waited for it."""
        assert self.runtime.client is not None
        for entry in await list_recoveries(self.runtime.client, self.runtime.keys, job_id):
            if entry.done_at is None and role in entry.waiting_for:
                entry.waiting_for.remove(role)
                entry.replacements.append(instance_id)
                if not entry.waiting_for:
                    entry.done_at = time.time()
                    log.warning(
                        "recovery.done",
                        job=job_id,
                        incident=entry.incident_id,
                        replacements=entry.replacements,
                        recovery_s=round(entry.recovery_s or 0.0, 2),
                    )
                await self._save(entry)
                await self._account(entry)
                return


async def list_recoveries(
    client: aetcd.Client, keys: KeySpace, job_id: str
) -> list[RecoveryRecord]:
    rows = await client.get_prefix(keys.recoveries(job_id))
    return sorted(
        (RecoveryRecord.model_validate_json(kv.value) for kv in rows),
        key=lambda r: r.detected_at,
    )
