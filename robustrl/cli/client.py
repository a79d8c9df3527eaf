"""The stack as the CLI sees it: etcd endpoints in; coordinator calls, members, incidents out."""

from __future__ import annotations

import json
import time
from typing import Any

from robustrl.contracts import packed
from robustrl.contracts.ettr import EttrAccount
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.ledger import WorkLedger, dropped_pages
from robustrl.contracts.members import MemberRecord
from robustrl.core.channels import DEFAULT_DEADLINE
from robustrl.core.config import EtcdSettings
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.etcd_client import connect_etcd


class StackClient(CoordinatorClient):
    @classmethod
    async def connect(cls, endpoints: str, prefix: str) -> StackClient:
        settings = EtcdSettings(endpoints=endpoints, prefix=prefix)
        return cls(await connect_etcd(settings), KeySpace(prefix))

    async def close(self) -> None:
        await self.etcd.close()

    async def members(self, role: str | None = None) -> list[MemberRecord]:
        members, _ = await self.registry.list(role)
        return members

    async def work_summary(self, job_id: str) -> dict[str, int] | None:
        """Counts from the job's work ledger: every group leased, and where it went."""
        raw = await self.etcd.get(self.keys.work(job_id))
        if raw is None:
            return None
        ledger = packed.load(WorkLedger, raw.value)
        return {
            "leased": ledger.next_index,
            "trained": ledger.trained,
            "dropped": ledger.dropped,
            "open": len(ledger.open),
            "delivered": len(ledger.delivered),
            "requeued": len(ledger.requeued),
            "taken_back": ledger.taken_back,
        }

    async def dropped_groups(self, job_id: str) -> dict[str, str] | None:
        """Every group the job dropped, with why: the pages moved out of its work ledger, then
        what the ledger still lists. None when the job has no ledger (yet)."""
        raw = await self.etcd.get(self.keys.work(job_id))
        if raw is None:
            return None
        dropped: dict[str, str] = {}
        for page in await dropped_pages(self.etcd, self.keys, job_id):
            dropped.update(page.discarded)
        dropped.update(packed.load(WorkLedger, raw.value).discarded)
        return dropped

    async def ettr(self, job_id: str) -> dict[str, Any] | None:
        """The job's ETTR summary as of now (None before the job started)."""
        raw = await self.etcd.get(self.keys.ettr(job_id))
        if raw is None:
            return None
        return packed.load(EttrAccount, raw.value).summary(time.time())

    async def recoveries(self, job_id: str) -> list[dict[str, Any]]:
        """What the leader did about each of the job's incidents (oldest first)."""
        rows = await self.etcd.get_prefix(self.keys.recoveries(job_id))
        records = sorted((json.loads(kv.value) for kv in rows), key=lambda r: r["detected_at"])
        for r in records:
            r["recovery_s"] = r["done_at"] - r["detected_at"] if r.get("done_at") else None
        return records

    async def incidents(self, job_id: str = "") -> list[dict[str, Any]]:
        result = await self.etcd.get_prefix(self.keys.incidents())
        records = [json.loads(kv.value) for kv in result]
        return [r for r in records if not job_id or r.get("job_id") == job_id]


__all__ = ["DEFAULT_DEADLINE", "StackClient"]
