"""Member binding: the leader binds a pending job to free members (Control BIND with the job's
spec and an epoch; a trainer also with its rank in the job's group), binds replacements for
the roles a running job lost (a trainer group as a whole, every rank at the new epoch), has
free warm standby trainers build a running job's model ahead (PREPARE), and releases the
members of a job that ended. Which members it picks is policy.replacement's choice; this
module carries it out over gRPC and records it in the job record."""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from collections.abc import Awaitable, Callable

import grpc

from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.fences import FenceSet
from robustrl.core.logs import get_logger
from robustrl.core.role_server import PREPARED_LABEL, RANK_ARG
from robustrl.core.runtime import ServiceRuntime
from services.coordinator import policy
from services.coordinator.asks import ProvisioningAsks
from services.coordinator.control import BIND, PREPARE, RELEASE, control, control_quietly
from services.coordinator.datasets import Datasets
from services.coordinator.job_records import JobRecords
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.ledgers import Ledgers

log = get_logger(__name__)

PREPARE_DEADLINE = 600.0
"""Seconds a standby gets to build a job's model ahead of need (PREPARE)."""

START_BIND_DEADLINE = PREPARE_DEADLINE
"""Seconds a member gets to accept a pending job's BIND: it builds the job's model first, as for
a PREPARE (a vLLM rollout starts its engine)."""

JOB_INPUT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})
"""A BIND refused with one of these is refused for the job's input: the job fails. Any other
refusal (a member slow or gone) leaves it pending for the next round."""

Bound = Callable[[str, str, str], Awaitable[None]]
"""Called with (job, role, instance) once a replacement is bound (the executor closes the
recovery that waited for it)."""

Fence = Callable[[str, int, str, str, str], Awaitable[None]]
"""Called with (job, epoch, role, instance, reason) to fence the instance from the job (the
executor's `fence`: the record, its weight-holder records withdrawn, the member told)."""


class Binder:
    def __init__(
        self,
        runtime: ServiceRuntime,
        jobs: JobRecords,
        ledgers: Ledgers,
        datasets: Datasets,
        asks: ProvisioningAsks,
        *,
        on_bound: Bound,
        fence: Fence,
        wake: Callable[[], None],
    ) -> None:
        self.runtime = runtime
        self.jobs = jobs
        self.ledgers = ledgers
        self.datasets = datasets
        self.asks = asks
        self.on_bound = on_bound
        self.fence = fence
        self.wake = wake
        self.fences: FenceSet | None = None
        """Every fence, followed by a watch from the first election on (`free_for`)."""
        self.barred: dict[str, set[str]] = {}
        """Job -> free members not bound to it because their id was fenced from it (logged once)."""
        self._preparing: dict[str, tuple[str, asyncio.Task[None]]] = {}
        """Standby -> the job a PREPARE sent to it is building (until it answers)."""
        self.prepared: dict[str, MemberRecord] = {}
        """Free standbys prepared for a running job (`policy.prepared_standbys`)."""

    async def follow_fences(self) -> None:
        """From the first election on, follow every fence; wait until they are loaded."""
        if self.fences is None:
            assert self.runtime.client is not None
            self.fences = FenceSet(self.runtime.client, self.runtime.keys)
            self.fences.start()
        await asyncio.wait_for(self.fences.loaded.wait(), self.runtime.etcd_settings.timeout)

    async def stop(self) -> None:
        await cancel_and_wait(*(task for _, task in self._preparing.values()))
        if self.fences is not None:
            await self.fences.stop()

    def free_for(self, job_id: str, members: list[MemberRecord]) -> dict[str, list[MemberRecord]]:
        """Free trainers and rollouts that may be bound to job_id (`policy.bindable`): not under
        an id fenced from it, by the same check the monitor answers beats with."""
        fences = self.fences
        assert fences is not None, "fences are followed from the first election on"
        free, barred = policy.bindable(members, lambda member: fences.fences(member, job_id))
        for instance_id in barred - self.barred.get(job_id, set()):
            log.warning(
                "coordinator.fenced_member_not_bound",
                job_id=job_id,
                member=instance_id,
                why="a process under this id was fenced from the job; give each process its own"
                " INSTANCE_ID",
            )
        self.barred[job_id] = barred
        return free

    async def start_job(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """Bind a pending job to its first members (`policy.start_members`) and run it."""
        spec = self.jobs.spec(record)
        start = policy.start_members(
            self.free_for(record.job_id, members),
            spec.rollout.replicas,
            spec.trainer.world_size,
        )
        if not start.members:
            if record.message != start.waiting:
                await self.jobs.update(record.job_id, {"message": start.waiting})
            return
        try:
            # Read at submit; again where this leader did not take the submission.
            dataset = await asyncio.to_thread(self.datasets.of, record.job_id, spec)
        except InvalidArgument as exc:
            await self.jobs.update(record.job_id, {}, Phase.FAILED, exc.message)
            return
        # Bound all at once: each loads the model (a vLLM rollout starts its engine) before it
        # answers, and the job starts when the slowest has, not after the sum of them all.
        spec_json = json.dumps(record.spec)
        answers = await asyncio.gather(
            *(
                control(
                    member,
                    BIND,
                    record.job_id,
                    FIRST_EPOCH,
                    _bind_args(spec_json, start.ranks.get(member.instance_id)),
                    timeout=START_BIND_DEADLINE,
                )
                for member in start.members
            ),
            return_exceptions=True,
        )
        refused: list[tuple[MemberRecord, grpc.aio.AioRpcError]] = []
        for member, answer in zip(start.members, answers, strict=True):
            if isinstance(answer, grpc.aio.AioRpcError):
                refused.append((member, answer))
            elif answer is not None:
                raise answer
        if refused:
            for member, answer in zip(start.members, answers, strict=True):
                if answer is None:
                    await control_quietly(member, RELEASE, record.job_id, FIRST_EPOCH)
            # The job's own input first: a member that was merely slow or gone says less.
            member, error = min(refused, key=lambda r: r[1].code() not in JOB_INPUT_CODES)
            message = f"{member.role} {member.instance_id} refused the job: {error.details()}"
            log.warning("coordinator.bind_failed", job=record.job_id, reason=message)
            if error.code() in JOB_INPUT_CODES:
                await self.jobs.update(record.job_id, {}, Phase.FAILED, message)
            return
        await self.ledgers.open(record.job_id)
        self.datasets.keep(record.job_id, dataset)
        await self.jobs.update(
            record.job_id,
            {
                "members": [m.instance_id for m in start.members],
                "member_roles": {m.instance_id: m.role for m in start.members},
                "member_ranks": start.ranks,
                "epoch": FIRST_EPOCH,
            },
            Phase.RUNNING,
            "running",
        )
        log.info(
            "coordinator.job_started",
            job=record.job_id,
            members=[m.instance_id for m in start.members],
        )

    async def fill(self, record: JobRecord, members: list[MemberRecord]) -> None:
        """Bind replacements for roles the job lost (recovery fenced them): a free member if
        there is one (`policy.replacement_order`, `policy.replacement_step`: one not prepared
        for this job is sent PREPARE and bound once it answers, the answer waking the next
        round), else ask the provisioner. A new trainer comes with a new epoch; the ranks of a
        trainer group are bound together, once every one of them is prepared
        (`_bind_group`)."""
        spec = self.jobs.spec(record)
        missing = policy.roles_missing(record, spec.rollout.replicas, spec.trainer.world_size)
        if not missing:
            return
        epoch = policy.replacement_epoch(record.epoch, missing)
        candidates = self.free_for(record.job_id, members)
        free = {
            role: policy.replacement_order(found, record.job_id)
            for role, found in candidates.items()
        }
        shortfall = Counter(missing)
        bound: list[MemberRecord] = []
        group: list[MemberRecord] = []
        """Trainers prepared for the job, bound together once the whole group is."""
        for role in list(shortfall):
            while shortfall[role] and free[role]:
                member = free[role].pop(0)
                preparing = self._preparing.get(member.instance_id)
                step = policy.replacement_step(
                    member, record.job_id, preparing[0] if preparing else None
                )
                if step is policy.Step.SKIP:
                    continue
                if step is policy.Step.PREPARE:
                    self._start_prepare(member, record)
                if step is not policy.Step.BIND:
                    shortfall[role] -= 1  # it will be bound when prepared
                    continue
                if role == "trainer":
                    group.append(member)
                    shortfall[role] -= 1
                    continue
                try:
                    await control(
                        member, BIND, record.job_id, epoch, {"spec_json": json.dumps(record.spec)}
                    )
                except grpc.aio.AioRpcError as exc:  # fenced, busy or gone: try the next one
                    log.info(
                        "coordinator.bind_failed", member=member.instance_id, error=exc.details()
                    )
                    continue
                bound.append(member)
                shortfall[role] -= 1
        ranks: dict[str, int] = {}
        if group and len(group) == missing.count("trainer"):
            ranks = await self._bind_group(record, group, epoch)
            bound += [m for m in group if m.instance_id in ranks]
        for role, short in shortfall.items():
            if short:
                await self.asks.ask(record.job_id, role, short, {m.instance_id for m in members})
            else:
                await self.asks.satisfied(record.job_id, role)
        if not bound:
            return
        for member in bound:
            if policy.is_standby(member):
                await self.asks.replace_standby(record.job_id, member)
        done = policy.filled(record, bound, epoch, ranks)
        await self.jobs.update(record.job_id, done.change, done.phase, done.message)
        for member in bound:
            log.warning(
                "coordinator.replacement_bound",
                job=record.job_id,
                member=member.instance_id,
                role=member.role,
                epoch=epoch,
            )
            await self.on_bound(record.job_id, member.role, member.instance_id)

    async def _bind_group(
        self, record: JobRecord, group: list[MemberRecord], epoch: int
    ) -> dict[str, int]:
        """BIND every trainer of a group at `epoch` with its rank, all at once (each then
        waits for the others in the rendezvous); their ranks, or {} if any refused (those
        bound are released, and the next round tries again)."""
        ranks = policy.group_ranks(group)
        spec_json = json.dumps(record.spec)
        answers = await asyncio.gather(
            *(
                control(m, BIND, record.job_id, epoch, _bind_args(spec_json, ranks[m.instance_id]))
                for m in group
            ),
            return_exceptions=True,
        )
        refused = [
            (m, a) for m, a in zip(group, answers, strict=True) if isinstance(a, BaseException)
        ]
        if not refused:
            return ranks
        for member, error in refused:
            log.info("coordinator.bind_failed", member=member.instance_id, error=repr(error)[:300])
        for member, answer in zip(group, answers, strict=True):
            if not isinstance(answer, BaseException):
                await control_quietly(member, RELEASE, record.job_id, epoch)
        return {}

    def prepare_standbys(self, records: list[JobRecord], members: list[MemberRecord]) -> None:
        """Have each free warm standby build a running job's worker ahead (PREPARE), so that
        taking over after a failure only restores a checkpoint (a trainer) or starts
        generating with the weights it kept pulling (a rollout)
        (`policy.standbys_to_prepare`). Sent in the background: a model load takes a while."""
        running = {r.job_id: r for r in records if r.phase in (Phase.RUNNING, Phase.RECOVERING)}
        self.prepared = policy.prepared_standbys(self.prepared, members, list(running))
        if not running:
            return
        preparing = {name: job for name, (job, _) in self._preparing.items()}
        for member, job_id in policy.standbys_to_prepare(list(running), members, preparing):
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
            await control(
                member,
                PREPARE,
                record.job_id,
                member.epoch,
                {"spec_json": json.dumps(record.spec)},
                timeout=PREPARE_DEADLINE,
            )
        except grpc.aio.AioRpcError as exc:  # busy, bound meanwhile or gone: the next tick sees
            log.info("coordinator.prepare_failed", member=member.instance_id, error=exc.details())

    async def standby_lost(self, incident: IncidentRecord) -> None:
        """A free member's incident (it serves no job, so no recovery follows): if it was a
        standby prepared for a running job, fence it from that job, so that it is never bound
        should it come back (a hung one resumes), and ask for another standby in its place."""
        member = self.prepared.pop(incident.instance_id, None)
        if member is None:
            member = await self._labelled_prepared(incident.instance_id)
        if member is None:
            return
        job_id = member.labels[PREPARED_LABEL]
        record, _ = await self.jobs.store.get(job_id)
        if record.phase not in (Phase.RUNNING, Phase.RECOVERING):
            return
        reason = f"{incident.kind} of a standby prepared for the job: {incident.evidence}"
        await self.fence(job_id, record.epoch, member.role, member.instance_id, reason)
        log.warning(
            "coordinator.standby_lost",
            job=job_id,
            member=member.instance_id,
            role=member.role,
            kind=incident.kind,
        )
        await self.asks.replace_standby(job_id, member)

    async def _labelled_prepared(self, instance_id: str) -> MemberRecord | None:
        """The free standby `instance_id` as the member cache holds it, if it is labelled as
        prepared for a job: one lost right after it prepared, before a round saw its label."""
        members, _ = await self.jobs.members.list()
        for member in members:
            if member.instance_id == instance_id and policy.is_standby(member):
                return member if policy.is_prepared_standby(member) else None
        return None

    async def release(self, job_id: str, members: list[MemberRecord]) -> None:
        """Release the members still bound to an ended job (every rank of its trainer group)."""
        for member in members:
            if member.job_id == job_id:
                await control_quietly(member, RELEASE, job_id, member.epoch)

    def forget(self, job_id: str) -> None:
        self.barred.pop(job_id, None)


def _bind_args(spec_json: str, rank: int | None) -> dict[str, str]:
    """BIND's args: the job's spec, and a trainer's rank in its group."""
    return {"spec_json": spec_json} | ({RANK_ARG: str(rank)} if rank is not None else {})
