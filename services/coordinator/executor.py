"""The recovery executor: the leader turns incidents into the policy's actions, and records
each one in etcd (`<prefix>/recovery/<job>/<incident id>`), where `robustrl status` reads it.

It follows the incident log the monitor writes. A new leader lists the log again, and an
incident that already has a recovery record is never acted on twice. Replacements are bound
by the driver's supervision round (a free member, else one the provisioner starts); the
record is closed when the replacement serves the job.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import aetcd
import grpc
from pydantic import BaseModel, Field

from robustrl.contracts.errors import NotFound
from robustrl.contracts.ettr import IncidentTiming
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.fences import FenceRecord, withdraw_holder_records, write_fence
from robustrl.core.incident_log import IncidentLog
from robustrl.core.logs import get_logger
from robustrl.core.role_server import EXIT_ARG
from robustrl.v1 import trainer_pb2
from services.coordinator import recovery, work
from services.coordinator.jobs import TERMINAL, JobRecord, Phase
from services.coordinator.recovery import Do

if TYPE_CHECKING:
    from services.coordinator.driver import JobDriver

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


def facts(record: JobRecord, spec_mode: str, nan_history: list[int]) -> recovery.JobFacts:
    return recovery.JobFacts(
        job_id=record.job_id,
        running=record.phase in (Phase.RUNNING, Phase.RECOVERING),
        mode=spec_mode,
        members={i: (role, record.epoch) for i, role in record.member_roles.items()},
        nan_history=tuple(nan_history),
    )


def serving_instance(record: JobRecord, incident: IncidentRecord) -> str:
    """The job member an incident is about: a trainer's follower rank maps to its rank 0."""
    if incident.instance_id in record.member_roles or incident.role != "trainer":
        return incident.instance_id
    for member, role in record.member_roles.items():
        if role == "trainer" and incident.instance_id.startswith(f"{member}-rank"):
            return member
    return incident.instance_id


class RecoveryExecutor:
    def __init__(self, driver: JobDriver) -> None:
        self.driver = driver
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def incident_log(self) -> IncidentLog:
        runtime = self.driver.runtime
        assert runtime.client is not None
        return IncidentLog(runtime.client, runtime.keys)

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
        if not self.driver.leadership.is_leader or not incident.job_id:
            return
        try:
            await self.handle(incident)
        except Exception as exc:  # one failed recovery must not stop the follower
            log.error("recovery.failed", incident=incident.incident_id, exc_info=exc)

    async def handle(self, incident: IncidentRecord) -> None:
        driver = self.driver
        client = driver.runtime.client
        keys = driver.runtime.keys
        assert client is not None
        async with driver.lock(incident.job_id):
            if await client.get(keys.recovery(incident.job_id, incident.incident_id)):
                return  # acted on already (by this leader or an earlier one)
            try:
                record, _ = await driver.store.get(incident.job_id)
            except NotFound:
                return
            if record.phase in TERMINAL:
                return
            spec = driver.spec(record)
            # Only the NaN policy looks at earlier NaN incidents: no log read for the others.
            nan_history = await self._nan_history(incident) if incident.kind == "NON_FINITE" else []
            member = serving_instance(record, incident)
            decided = recovery.decide(
                recovery.IncidentFacts(
                    incident_id=incident.incident_id,
                    job_id=incident.job_id,
                    role=incident.role,
                    instance_id=member,
                    # Membership is the staleness test: a fenced instance left the members
                    # (the monitor knows process epochs, not binding epochs).
                    epoch=record.epoch,
                    kind=incident.kind,
                    rank=incident.rank,
                    step=record.step,
                ),
                facts(record, spec.recovery.mode, nan_history),
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
            await self._execute(record, decided, entry)
            await self._save(entry)
            await self._account(entry)
        if entry.waiting_for:
            self.driver.wake()  # bind the replacement now, not at the next tick

    async def _execute(
        self, record: JobRecord, actions: list[recovery.Action], entry: RecoveryRecord
    ) -> None:
        driver = self.driver
        roles = dict(record.member_roles)
        fenced: list[str] = []
        phase: Phase | None = None
        failure = ""  # the job's own fault: it fails, with this message
        for action in actions:
            if action.do is Do.FENCE:
                await self._fence(record, action.instance_id, action.reason)
                fenced.append(action.instance_id)
            elif action.do is Do.REQUEUE:
                ledger = driver.ledgers.get(record.job_id)
                if ledger is not None:
                    taken = driver.release_lost_holder(
                        record, ledger, action.instance_id, action.reason
                    )
                    await driver.save_ledger(ledger)
                    log.info("recovery.requeued", job=record.job_id, groups=len(taken))
                    failure = driver.poison_verdict(record, ledger)
                    if failure:
                        break  # the job fails: nothing is replaced
            elif action.do is Do.REPLACE_ROLLOUT:
                entry.waiting_for.append("rollout")
            elif action.do is Do.RESTORE_TRAINER:
                entry.waiting_for.append("trainer")
                phase = Phase.RECOVERING
                ledger = driver.ledgers.get(record.job_id)
                if ledger is not None:
                    work.trainer_replaced(ledger)
                    await driver.save_ledger(ledger)
            elif action.do is Do.ROLLBACK:
                # The trainer skipped the poisoned step (no optimizer update, weights and
                # optimizer state untouched): the rollback to the last good state is done.
                entry.done_at = time.time()
            elif action.do is Do.FULL_RESTART:
                await self._full_restart(record, action.reason, entry)
                return
        members = [m for m in record.members if m not in fenced]
        for gone in fenced:
            roles.pop(gone, None)
        if failure:
            await driver.fail(record.job_id, failure, {"members": members, "member_roles": roles})
            return
        message = f"recovering from {entry.kind} of {entry.instance_id}"
        await driver.update_job(
            record.job_id,
            {"members": members, "member_roles": roles},
            phase,
            message if phase else record.message,
        )

    async def _full_restart(self, record: JobRecord, reason: str, entry: RecoveryRecord) -> None:
        """The baseline: every role restarts as a new process and the job resumes from the last
        checkpoint. The failed member is fenced; every other member of the job is released and
        exits, so its replacement pays a process start-up and a model load, as a restart does.
        Replacements are bound as after any failure: a prepared warm standby trainer if there
        is one, else members the provisioner starts."""
        driver = self.driver
        await self._fence(record, entry.instance_id, reason)
        members, _ = await driver.registry.list()
        for member in members:
            if (
                member.instance_id in record.member_roles
                and member.instance_id != entry.instance_id
            ):
                await driver.control_quietly(
                    member,
                    trainer_pb2.ControlRequest.ACTION_RELEASE,
                    record.job_id,
                    record.epoch,
                    {EXIT_ARG: "true"},
                )
        ledger = driver.ledgers.get(record.job_id)
        if ledger is not None:
            # Open leases and delivered-but-untrained groups alike lived in roles that are
            # thrown away (the rollouts' memory, the trainer's intake): generate them again.
            for group in [*ledger.open, *ledger.delivered]:
                work.take_back(ledger, group, f"full restart ({reason})")
            # So are the rollouts that held the groups of steps after the last checkpoint: the
            # new trainer's first report hands them back (work.release_lost).
            work.trainer_replaced(ledger)
            await driver.save_ledger(ledger)
        entry.waiting_for = list(record.member_roles.values())
        await driver.update_job(
            record.job_id,
            {"members": [], "member_roles": {}},
            Phase.RECOVERING,
            f"full restart after {entry.kind} of {entry.instance_id}",
        )

    async def _fence(self, record: JobRecord, instance_id: str, reason: str) -> None:
        runtime = self.driver.runtime
        assert runtime.client is not None
        await write_fence(
            runtime.client,
            runtime.keys,
            FenceRecord(
                instance_id=instance_id, job_id=record.job_id, epoch=record.epoch, reason=reason
            ),
        )
        withdrawn = await withdraw_holder_records(
            runtime.client, runtime.keys, record.job_id, instance_id
        )
        log.warning(
            "recovery.fenced",
            job=record.job_id,
            member=instance_id,
            reason=reason,
            holder_records=withdrawn,
        )
        role = record.member_roles.get(instance_id, "trainer")  # follower ranks are trainers
        member = await self.driver.registry.get(role, instance_id)
        if member is not None:
            # Tell it too, without waiting on a process that may be stopped or dead.
            task = asyncio.create_task(self._tell_fenced(member, record))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _tell_fenced(self, member: MemberRecord, record: JobRecord) -> None:
        try:
            await asyncio.wait_for(
                self.driver.control(
                    member, trainer_pb2.ControlRequest.ACTION_FENCE, record.job_id, record.epoch
                ),
                FENCE_DEADLINE,
            )
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.info("recovery.fence_unheard", member=member.instance_id, error=repr(exc)[:200])

    async def _nan_history(self, incident: IncidentRecord) -> list[int]:
        """Ranks of the job's earlier NaN incidents, oldest first (this one left out)."""
        records, _ = await self.incident_log.list(incident.job_id, kind="NON_FINITE")
        return [r.rank for r in records if r.incident_id != incident.incident_id]

    async def _account(self, entry: RecoveryRecord) -> None:
        """The incident's timeline in the job's ETTR account."""
        account = self.driver.accounts.get(entry.job_id)
        if account is None:
            return
        account.add_incident(
            IncidentTiming(
                incident_id=entry.incident_id,
                kind=entry.kind,
                role=entry.role,
                instance_id=entry.instance_id,
                detected_at=entry.detected_at,
                recovered_at=entry.done_at,
            )
        )
        await self.driver.save_account(entry.job_id)

    async def _save(self, entry: RecoveryRecord) -> None:
        runtime = self.driver.runtime
        assert runtime.client is not None
        await runtime.client.put(
            runtime.keys.recovery(entry.job_id, entry.incident_id),
            entry.model_dump_json().encode(),
        )

    async def bound(self, job_id: str, role: str, instance_id: str) -> None:
        """The driver bound `instance_id` as `role` to the job: close what waited for it."""
        runtime = self.driver.runtime
        assert runtime.client is not None
        for entry in await list_recoveries(runtime.client, runtime.keys, job_id):
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
