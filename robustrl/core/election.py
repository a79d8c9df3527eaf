"""Leader election on etcd, the same protocol as etcd's concurrency.Election.

Each candidate writes `<election prefix><lease id>` under its session lease; the candidate
whose key has the lowest create revision is the leader. A candidate waits for the key just
before its own to be deleted, then checks again. When the leader's process dies, its lease
expires and its key goes, so the next candidate leads within the session TTL. A candidate
next in line can be given a test for a leader that is gone for certain (`gone`: the
coordinator's is an address that refuses connections): it then revokes the leader's lease,
whose id is in its key, and leads at once instead of waiting out the TTL.

Writes that only the leader may make compare the leader key's create revision in the same
transaction (`leader_guard`), so a deposed leader can never write, even if it has not yet
noticed it lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aetcd

from robustrl.core.logs import get_logger
from robustrl.core.session import Session
from robustrl.core.watch import Delete, Entry, Resync, list_prefix, watch_prefix

log = get_logger(__name__)

GONE_CHECK_INTERVAL = 0.25
"""Seconds between two `gone` tests of the leader by the candidate next in line."""

Gone = Callable[[Entry], Awaitable[bool]]
"""True when the candidate of this entry is gone for certain (its process is dead)."""


class Election:
    def __init__(
        self, client: aetcd.Client, prefix: bytes, session: Session, gone: Gone | None = None
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.session = session
        self.gone = gone
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
            # Next in line behind the leader: this candidate may unseat a dead one.
            unseat = len(earlier) == 1 and self.gone is not None
            await self._wait_deleted(blocker, revision + 1, unseat)

    async def _wait_deleted(self, blocker: Entry, start_revision: int, unseat: bool) -> None:
        """Until the blocker's key goes (or, with `unseat`, this candidate revoked its lease:
        the caller lists the keys again either way)."""
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(self._deleted(blocker.key, start_revision)),
            lost := asyncio.create_task(self.session.done.wait()),
        ]
        if unseat:
            tasks.append(asyncio.create_task(self._unseat_when_gone(blocker)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if lost in done:
                raise RuntimeError("session lost while campaigning")
        finally:
            for task in tasks:
                task.cancel()

    async def _unseat_when_gone(self, leader: Entry) -> None:
        """Once `gone` finds the leader dead, revoke its lease: its key goes with the lease.
        Runs until then."""
        assert self.gone is not None
        while True:
            if await self.gone(leader):
                break
            await asyncio.sleep(GONE_CHECK_INTERVAL)
        lease_id = int(leader.key[len(self.prefix) :], 16)
        log.info("election.leader_unseated", lease=f"{lease_id:x}", leader=leader.value.decode())
        try:
            await self.client.revoke_lease(lease_id)
        except aetcd.exceptions.ClientError as exc:  # expired already: the key is gone too
            log.info("election.unseat_failed", error=repr(exc))

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
