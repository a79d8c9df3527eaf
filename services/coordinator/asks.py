"""Replacements asked of the provisioner: how many (policy.asks_due), when each was asked for
and the member it starts, kept in etcd at <prefix>/provisioning/<job> until the job needs none,
so that a leader elected while they start does not ask for them again. An ask is spent once
its member registers: from then on that member is counted as a free member of the job, and
the ask no longer counts as one coming."""

from __future__ import annotations

import json
import time

from robustrl.contracts.members import MemberRecord
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from services.coordinator import policy
from services.coordinator.leadership import Leadership
from services.coordinator.provisioner import NoProvisioner, Provisioner

log = get_logger(__name__)

Ask = tuple[float, str]
"""When a replacement was asked for, and the instance id the provisioner gave its member ("":
none, as when no provisioner runs or the ask was stored before ids were)."""


class ProvisioningAsks:
    def __init__(self, runtime: ServiceRuntime, leadership: Leadership) -> None:
        self.runtime = runtime
        self.leadership = leadership
        self.provisioner: Provisioner = NoProvisioner()
        self.asked: dict[tuple[str, str], list[Ask]] = {}
        """(job, role) -> replacements asked for whose members have not registered yet."""

    def clear(self) -> None:
        self.asked.clear()

    async def reload(self, job_id: str) -> None:
        """Load when the job's replacements were last asked for. An unreadable value is
        dropped: asking again costs little."""
        assert self.runtime.client is not None
        raw = await self.runtime.client.get(self.runtime.keys.provisioning(job_id))
        if raw is None:
            return
        try:
            asks = json.loads(raw.value)
            for role, entries in asks.items():
                # [time, instance id]; a bare time (stored before ids were) names no member.
                self.asked[(job_id, str(role))] = [
                    (float(e), "") if isinstance(e, int | float) else (float(e[0]), str(e[1]))
                    for e in entries
                ]
        except (ValueError, TypeError, AttributeError, IndexError) as exc:
            log.warning("coordinator.asks_unreadable", job=job_id, error=repr(exc))

    async def ask(self, job_id: str, role: str, count: int, registered: set[str]) -> None:
        """Have `count` more members of `role` coming, beyond those `registered` (the
        registry's instance ids): ask for those not asked for recently. An ask whose member
        has registered is spent, whether or not that member is still there."""
        now = time.time()
        earlier = self.asked.get((job_id, role), [])
        waiting = [(t, i) for t, i in earlier if not i or i not in registered]
        coming, due = policy.asks_due([t for t, _ in waiting], count, now)
        asked = self.asked[(job_id, role)] = [(t, i) for t, i in waiting if t in coming]
        try:
            for _ in range(due):
                try:
                    member = await self.provisioner.request(
                        role, job_id, f"replacement for job {job_id}"
                    )
                except Exception as exc:
                    log.error(
                        "coordinator.provision_failed", role=role, job=job_id, error=repr(exc)
                    )
                    return
                asked.append((now, member))
        finally:
            if asked != earlier:
                await self.save(job_id)

    async def satisfied(self, job_id: str, role: str) -> None:
        """The job needs no more of `role`: what was asked for is no longer awaited."""
        if self.asked.pop((job_id, role), None):
            await self.save(job_id)

    def failed(self, job_id: str, role: str) -> None:
        """The provisioner will not deliver a member it was asked for: the next supervision
        round asks again instead of waiting out the de-duplication window."""
        asked = self.asked.get((job_id, role))
        if asked:
            asked.pop(0)

    async def replace_standby(self, job_id: str, standby: MemberRecord) -> None:
        """A warm standby was bound (or lost): ask for another of its role, so that the next
        failure of that role does not wait for a cold start. It counts as a replacement of
        that role coming for the job: a loss before it registers waits for it instead of
        asking for a cold member as well (two process starts on the job's hosts for one)."""
        try:
            member = await self.provisioner.request(
                standby.role, job_id, f"replacing standby {standby.instance_id}", True
            )
        except Exception as exc:
            log.error("coordinator.provision_failed", role="standby", error=repr(exc))
            return
        self.asked.setdefault((job_id, standby.role), []).append((time.time(), member))
        await self.save(job_id)

    def awaiting(self, job_id: str) -> bool:
        return any(job == job_id for job, _ in self.asked)

    def forget(self, job_id: str) -> None:
        for key in [k for k in self.asked if k[0] == job_id]:
            del self.asked[key]

    async def save(self, job_id: str) -> None:
        """Store when this job's replacements were asked for (deleted once none is awaited).
        A write that fails costs only a second ask after a failover: logged, not raised."""
        client = self.runtime.client
        assert client is not None
        key, tx = self.runtime.keys.provisioning(job_id), client.transactions
        asks = {role: entries for (job, role), entries in self.asked.items() if job == job_id}
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
