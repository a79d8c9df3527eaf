"""Job records in etcd, written only with compare-and-swap.

Every write compares the job key's mod revision (a lost race is ABORTED, never a silent
overwrite) and, when a `guard` is given, that the writer still holds the coordinator
election (a deposed leader's write fails instead of landing).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aetcd

from robustrl.contracts.errors import Aborted, AlreadyExists, NotFound, Unavailable
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.keys import KeySpace
from robustrl.core.watch import Delete, Put, Resync, list_prefix, watch_prefix
from services.coordinator.jobs import JobRecord

DELETE_BATCH = 64
"""Deletions per etcd transaction when a job is deleted (etcd allows 128 operations)."""

Versioned = tuple[JobRecord, int]
"""A job record and the etcd mod revision it was read at."""


class LostLeadership(Unavailable):
    def __init__(self) -> None:
        super().__init__("this coordinator lost leadership during the write; retry")


class JobStore:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys

    async def create(self, record: JobRecord, guard: list[Any]) -> int:
        tx = self.client.transactions
        key = self.keys.job(record.job_id)
        ok, responses = await self.client.transaction(
            compare=[*guard, tx.create(key) == 0],
            success=[tx.put(key, record.model_dump_json().encode())],
            failure=[tx.get(key)],
        )
        if ok:
            return int(responses[0].response_put.header.revision)
        if responses[0]:
            raise AlreadyExists(f"job {record.job_id!r} already exists")
        raise LostLeadership()

    async def get(self, job_id: str) -> Versioned:
        result = await self.client.get(self.keys.job(job_id))
        if result is None:
            raise NotFound(f"job {job_id!r} not found")
        return JobRecord.model_validate_json(result.value), result.mod_revision

    async def list_all(self) -> tuple[list[Versioned], int]:
        result = await self.client.get_prefix(self.keys.jobs())
        jobs = [(JobRecord.model_validate_json(kv.value), kv.mod_revision) for kv in result]
        jobs.sort(key=lambda item: item[0].created_at)
        return jobs, result.header.revision

    async def update(self, record: JobRecord, expected_revision: int, guard: list[Any]) -> int:
        """Write record if the stored one is still at expected_revision."""
        tx = self.client.transactions
        key = self.keys.job(record.job_id)
        ok, responses = await self.client.transaction(
            compare=[*guard, tx.mod(key) == expected_revision],
            success=[tx.put(key, record.model_dump_json().encode())],
            failure=[tx.get(key)],
        )
        if ok:
            return int(responses[0].response_put.header.revision)
        current = responses[0]
        if not current:
            raise NotFound(f"job {record.job_id!r} not found")
        _, kv = current[0]
        if kv.mod_revision != expected_revision:
            raise Aborted(
                f"job {record.job_id!r} changed concurrently (revision {expected_revision} -> "
                f"{kv.mod_revision}); re-read it and retry"
            )
        raise LostLeadership()

    async def delete(self, job_id: str, expected_revision: int, guard: list[Any]) -> int:
        """Delete the job's record and every key it left in etcd; return how many went.

        Its incidents go first and its record last, in transactions that each compare the
        record's revision and the guard, so an interrupted delete leaves the job listed, and
        deleting it again finishes the work. An incident never outlives its recovery record
        (a new leader would act on it again). Weight holder records under another live lease
        are deleted too; that holder only serves a job nobody pulls any more. Fences stay
        (one small key per failed instance): should a job of the same id be submitted again,
        a fenced instance of the old one is still refused.
        """
        tx = self.client.transactions
        key = self.keys.job(job_id)
        entries, _ = await list_prefix(self.client, self.keys.incidents())
        ops = [
            tx.delete(e.key)
            for e in entries
            if IncidentRecord.model_validate_json(e.value).job_id == job_id
        ]
        for prefix in (
            self.keys.recoveries(job_id),
            self.keys.dropped_pages(job_id),
            self.keys.weights(job_id) + b"/",
        ):
            ops.append(tx.delete(prefix, range_end=aetcd.utils.prefix_range_end(prefix)))
        for exact in (
            self.keys.work(job_id),
            self.keys.ettr(job_id),
            self.keys.weights(job_id),
            self.keys.provisioning(job_id),
        ):
            ops.append(tx.delete(exact))
        ops.append(tx.delete(key))
        deleted = 0
        for start in range(0, len(ops), DELETE_BATCH):
            ok, responses = await self.client.transaction(
                compare=[*guard, tx.mod(key) == expected_revision],
                success=ops[start : start + DELETE_BATCH],
                failure=[tx.get(key)],
            )
            if not ok:
                current = responses[0]
                if not current:
                    raise NotFound(f"job {job_id!r} not found")
                if current[0][1].mod_revision != expected_revision:
                    raise Aborted(f"job {job_id!r} changed while it was being deleted; retry")
                raise LostLeadership()
            deleted += sum(int(r.response_delete_range.deleted) for r in responses)
        return deleted

    async def watch(self, job_id: str, after_revision: int) -> AsyncIterator[Versioned]:
        """The job's record each time it changes after after_revision."""
        key = self.keys.job(job_id)
        async for event in watch_prefix(self.client, key, after_revision + 1):
            if isinstance(event, Put) and event.entry.key == key:
                yield JobRecord.model_validate_json(event.entry.value), event.entry.mod_revision
            elif isinstance(event, Resync):
                for entry in event.entries:
                    if entry.key == key:
                        yield JobRecord.model_validate_json(entry.value), entry.mod_revision
            elif isinstance(event, Delete) and event.key == key:
                return
