"""Fencing: once the coordinator replaces an instance, nothing it sends is accepted again.

The leader writes `<prefix>/fences/<instance_id>` (no lease: a fence outlives the process)
before it starts a replacement, and removes the instance from the job's members, which is
how the coordinator refuses its LeaseWork / CompleteWork / ReportProgress. Every other
receiver checks the fence: the trainer refuses its trajectories, the monitor answers its
beats with `fenced`, and rollouts ignore weight manifests of older trainer epochs. The leader
also deletes the instance's weight-holder records, so no rollout goes on pulling weights from
it. A process stopped with SIGSTOP and continued after its replacement therefore changes
nothing; on its next beat it learns it was fenced and stops its work.
"""

from __future__ import annotations

import asyncio
import time

import aetcd
from pydantic import BaseModel, Field

from robustrl.contracts.keys import KeySpace, WeightKeys
from robustrl.core.aio import cancel_and_wait
from robustrl.core.etcd_client import until_etcd_answers
from robustrl.core.logs import get_logger
from robustrl.core.watch import Delete, Entry, Put, Resync, list_prefix, watch_prefix

log = get_logger(__name__)


class FenceRecord(BaseModel):
    instance_id: str
    job_id: str
    epoch: int
    """The job epoch the instance served; the replacement serves a higher one."""
    reason: str
    at: float = Field(default_factory=time.time)


async def write_fence(client: aetcd.Client, keys: KeySpace, record: FenceRecord) -> None:
    await client.put(keys.fence(record.instance_id), record.model_dump_json().encode())


async def withdraw_holder_records(
    client: aetcd.Client, keys: KeySpace, job_id: str, instance_id: str
) -> int:
    """Delete the fenced instance's records as a holder of the job's weight versions; returns
    how many there were.

    A stopped holder keeps its records until its lease expires, and a puller receiving from it
    waits until then; pullers watch the records and move to another holder once they go.
    """
    wkeys = WeightKeys(keys)
    entries, _ = await list_prefix(client, wkeys.versions(job_id))
    withdrawn = 0
    for entry in entries:
        parsed = wkeys.parse(job_id, entry.key)
        if parsed is not None and parsed[1] == f"holders/{instance_id}":
            await client.delete(entry.key)
            withdrawn += 1
    return withdrawn


class FenceSet:
    """The fenced instance ids, kept current by an etcd watch; `in` is a set lookup."""

    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys
        self.records: dict[str, FenceRecord] = {}
        self.loaded = asyncio.Event()
        """Set once the first read of every fence is in `records`."""
        self._task: asyncio.Task[None] | None = None

    def fences(self, instance_id: str, job_id: str, epoch: int | None = None) -> bool:
        """Whether `instance_id` is fenced from `job_id` (at `epoch`, if given: a fresh binding
        at a higher epoch is a new incarnation and is not)."""
        record = self.records.get(instance_id)
        if record is None or record.job_id != job_id:
            return False
        return epoch is None or epoch <= record.epoch

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="fences")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _follow(self) -> None:
        entries, revision = await until_etcd_answers(
            lambda: list_prefix(self.client, self.keys.fences()), "reading the fences"
        )
        self._replace(entries)
        self.loaded.set()
        async for event in watch_prefix(self.client, self.keys.fences(), revision + 1):
            if isinstance(event, Put):
                record = _readable(event.entry)
                if record is not None:
                    self.records[record.instance_id] = record
                    log.info("fence.seen", member=record.instance_id, job=record.job_id)
            elif isinstance(event, Delete):
                self.records.pop(event.key.decode().rsplit("/", 1)[1], None)
            elif isinstance(event, Resync):
                self._replace(event.entries)

    def _replace(self, entries: list[Entry]) -> None:
        records = [r for r in map(_readable, entries) if r is not None]
        self.records = {r.instance_id: r for r in records}


def _readable(entry: Entry) -> FenceRecord | None:
    """The fence at entry, or None (logged) for one that cannot be read: it must not end the
    watch, after which no later fence would be seen."""
    try:
        return FenceRecord.model_validate_json(entry.value)
    except ValueError as exc:
        log.warning("fence.unreadable", key=entry.key.decode(), error=str(exc).split("\n")[0])
        return None
