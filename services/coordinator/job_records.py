"""The job records as the leader reads and changes them: the store under its leadership
guard, one lock per job (every change to a job's state is made under it), the parsed specs,
and the incident log the leader records its own findings in."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from robustrl.contracts.errors import Aborted
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.incident_log import IncidentLog
from robustrl.core.logs import get_logger
from robustrl.core.member_cache import MemberCache
from robustrl.core.registry import Registry
from robustrl.core.runtime import ServiceRuntime
from services.coordinator import jobs
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.leadership import Leadership
from services.coordinator.store import JobStore

log = get_logger(__name__)


class JobRecords:
    def __init__(self, runtime: ServiceRuntime, leadership: Leadership) -> None:
        self.runtime = runtime
        self.leadership = leadership
        self.specs: dict[str, tuple[dict[str, object], JobSpec]] = {}
        """Job id -> its stored spec and that spec parsed."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._members: MemberCache | None = None

    def start(self) -> None:
        """Start following the registry (once the runtime is connected to etcd)."""
        self._members = MemberCache(self.registry)
        self._members.start()

    async def stop(self) -> None:
        if self._members is not None:
            await self._members.stop()

    @property
    def store(self) -> JobStore:
        assert self.runtime.client is not None
        return JobStore(self.runtime.client, self.runtime.keys)

    @property
    def registry(self) -> Registry:
        assert self.runtime.registry is not None
        return self.runtime.registry

    @property
    def members(self) -> MemberCache:
        """The registry held in memory: what the rounds and ListMembers read (`start` first)."""
        assert self._members is not None
        return self._members

    @property
    def incident_log(self) -> IncidentLog:
        assert self.runtime.client is not None
        return IncidentLog(self.runtime.client, self.runtime.keys)

    def lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def spec(self, record: JobRecord) -> JobSpec:
        cached = self.specs.get(record.job_id)
        # UpdateJob changes a stored spec (its step budget), on whichever replica leads then.
        if cached is not None and cached[0] == record.spec:
            return cached[1]
        spec = JobSpec.model_validate(record.spec)
        self.specs[record.job_id] = (record.spec, spec)
        return spec

    def unsupervisable(self, record: JobRecord) -> str | None:
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

    async def update(
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

    async def fail(
        self, job_id: str, message: str, changes: dict[str, object] | None = None
    ) -> None:
        """End the job as FAILED with `message`, applying `changes` to its record too."""
        await self.update(job_id, changes or {}, Phase.FAILED, message)
        log.warning("coordinator.job_failed", job=job_id, reason=message)
