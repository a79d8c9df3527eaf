"""Leader election on etcd, the same protocol as etcd's concurrency.Election.

Each candidate writes `<election prefix><lease id>` under its session lease; the candidate
whose key has the lowest create revision is the leader. A candidate waits for the key just
before its own to be deleted, then checks again. When the leader's process dies, its lease
expires and its key goes, so the next candidate leads within the session TTL.

Writes that only the leader may make compare the leader key's create revision in the same
transaction (`leader_guard`), so a deposed leader can never write, even if it has not yet
noticed it lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aetcd

from services.common.session import Session
from services.common.watch import Delete, Entry, Resync, list_prefix, watch_prefix


class Election:
    def __init__(self, client: aetcd.Client, prefix: bytes, session: Session) -> None:
        self.client = client
        self.prefix = prefix
        self.session = session
        self.key = prefix + f"{session.lease_id:x}".encode()
        self.revision = 0  # create revision of our key once we campaign

    async def campaign(self, value: bytes) -> None:
        """Block until this candidate leads. Cancel to give up."""
        tx = self.client.transactions
        succeeded, responses = await self.client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, value, lease=self.session.lease_id)],
            failure=[tx.get(self.key)],
        )
        if succeeded:
            self.revision = responses[0].response_put.header.revision
        else:
            _, existing = responses[0][0]
            self.revision = existing.create_revision
            if existing.value != value:
                await self.client.put(self.key, value, lease=self.session.lease_id)
        await self._wait_for_deletes()

    async def _wait_for_deletes(self) -> None:
        while True:
            entries, revision = await list_prefix(self.client, self.prefix)
            earlier = [e for e in entries if e.create_revision < self.revision]
            if not any(e.key == self.key for e in entries):
                raise RuntimeError("election key vanished while campaigning (session lost)")
            if not earlier:
                return
            blocker = max(earlier, key=lambda e: e.create_revision)
            await self._wait_deleted(blocker.key, revision + 1)

    async def _wait_deleted(self, key: bytes, start_revision: int) -> None:
        waiter: asyncio.Task[None] = asyncio.create_task(self._deleted(key, start_revision))
        lost = asyncio.create_task(self.session.done.wait())
        try:
            done, _ = await asyncio.wait({waiter, lost}, return_when=asyncio.FIRST_COMPLETED)
            if lost in done:
                raise RuntimeError("session lost while campaigning")
        finally:
            for task in (waiter, lost):
                task.cancel()

    async def _deleted(self, key: bytes, start_revision: int) -> None:
        async for event in watch_prefix(self.client, key, start_revision):
            if isinstance(event, Delete) and event.key == key:
                return
            if isinstance(event, Resync) and not any(e.key == key for e in event.entries):
                return

    async def resign(self) -> None:
        """Give up leadership (or candidacy): delete our key so the next candidate leads."""
        await self.client.delete(self.key)
        self.revision = 0

    def leader_guard(self) -> Any:
        """A transaction comparison that holds only while this candidate's key is unchanged."""
        return self.client.transactions.create(self.key) == self.revision


def _leader_of(entries: list[Entry]) -> Entry | None:
    return min(entries, key=lambda e: e.create_revision) if entries else None


async def current_leader(client: aetcd.Client, prefix: bytes) -> Entry | None:
    """The leading candidate's entry (value = what it advertised), or None."""
    entries, _ = await list_prefix(client, prefix)
    return _leader_of(entries)


async def observe(client: aetcd.Client, prefix: bytes) -> AsyncIterator[Entry | None]:
    """Yield the leader entry now and each time it changes (None while there is none)."""
    last: Entry | None = None
    first = True
    while True:
        entries, revision = await list_prefix(client, prefix)
        leader = _leader_of(entries)
        if first or leader != last:
            first = False
            last = leader
            yield leader
        async for _event in watch_prefix(client, prefix, revision + 1):
            break
