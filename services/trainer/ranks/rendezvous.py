"""Where the ranks of a trainer group meet: rank 0 writes its rendezvous store's address under
the job's key in etcd, with the group's epoch, under its own lease; every other rank waits for
the record of its own epoch and joins that store.

A rank only ever joins the group of the epoch it was bound at: a fenced rank (an older epoch)
never finds its record again (rank 0 withdraws it when its group closes, and its lease takes
it when the process dies), and a newer record tells it that it was replaced. The store itself
carries the epoch too (`RankGroup`), so a rank that read a record just before it changed
cannot join the wrong group."""

from __future__ import annotations

import asyncio
import time

import aetcd
from pydantic import BaseModel

from robustrl.contracts.errors import Fenced
from robustrl.contracts.keys import KeySpace

POLL_S = 0.2
"""How often a waiting rank reads the record."""


class Rendezvous(BaseModel):
    """The record at <prefix>/rendezvous/<job_id>."""

    job_id: str
    epoch: int
    master: str
    """Rank 0's store, host:port, at the address the other ranks reach it."""
    world_size: int


async def publish(client: aetcd.Client, keys: KeySpace, record: Rendezvous, lease_id: int) -> None:
    """Rank 0: the group of `record.epoch` meets at `record.master` (replaces any older one)."""
    await client.put(
        keys.rendezvous(record.job_id), record.model_dump_json().encode(), lease=lease_id
    )


async def withdraw(client: aetcd.Client, keys: KeySpace, record: Rendezvous) -> None:
    """Rank 0, its group closed: remove the record if it is still this group's."""
    key = keys.rendezvous(record.job_id)
    current = await client.get(key)
    if current is not None and Rendezvous.model_validate_json(current.value) == record:
        await client.delete(key)


async def meet(
    client: aetcd.Client, keys: KeySpace, job_id: str, epoch: int, timeout_s: float
) -> Rendezvous:
    """A rank > 0: the record of `epoch` once rank 0 has written it. Fenced if a newer epoch's
    group meets instead (this rank was replaced); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    key = keys.rendezvous(job_id)
    while True:
        found = await client.get(key)
        if found is not None:
            record = Rendezvous.model_validate_json(found.value)
            if record.epoch == epoch:
                return record
            if record.epoch > epoch:
                raise Fenced(
                    f"job {job_id}'s trainer group meets at epoch {record.epoch}; this rank was "
                    f"bound at {epoch}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 of job {job_id} at epoch {epoch} published no rendezvous within "
                f"{timeout_s:.0f}s"
            )
        await asyncio.sleep(POLL_S)
