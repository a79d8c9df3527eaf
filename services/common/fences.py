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

from services.common.aio import cancel_and_wait
from services.common.etcd_client import until_etcd_answers
from services.common.keys import KeySpace, WeightKeys
from services.common.logs import get_logger
from services.common.watch import Delete, Put, Resync, list_prefix, watch_prefix

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


async def fenced_from(
    client: aetcd.Client, keys: KeySpace, instance_ids: list[str], job_id: str
) -> set[str]:
    """Those of `instance_ids` whose fence names `job_id`.

    A fence names an instance id, and a process that starts under the id of one that was
    fenced (a container or pod restarted in place, or a fixed INSTANCE_ID) inherits it: bound
    to that job again, it would be told at its first beat that it is fenced and leave."""
    reads = await asyncio.gather(*(client.get(keys.fence(i)) for i in instance_ids))
    barred: set[str] = set()
    for instance_id, read in zip(instance_ids, reads, strict=True):
        if read is not None and FenceRecord.model_validate_json(read.value).job_id == job_id:
            barred.add(instance_id)
    return barred


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
        self._replace([FenceRecord.model_validate_json(e.value) for e in entries])
        async for event in watch_prefix(self.client, self.keys.fences(), revision + 1):
            if isinstance(event, Put):
                record = FenceRecord.model_validate_json(event.entry.value)
                self.records[record.instance_id] = record
                log.info("fence.seen", member=record.instance_id, job=record.job_id)
            elif isinstance(event, Delete):
                self.records.pop(event.key.decode().rsplit("/", 1)[1], None)
            elif isinstance(event, Resync):
                self._replace([FenceRecord.model_validate_json(e.value) for e in event.entries])

    def _replace(self, records: list[FenceRecord]) -> None:
        self.records = {r.instance_id: r for r in records}
