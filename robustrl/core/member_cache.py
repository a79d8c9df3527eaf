"""The registry's members held in memory, kept current by one etcd watch.

Listing the registry reads and parses every member record; at a thousand members that was most
of the coordinator's time (decision 0016). The cache lists once, then applies the watch's puts
and deletes, resuming after the last revision it applied and re-listing after a compaction
(`watch_prefix` hands it a `Resync`). A member record is parsed once, when it changes.

It trails etcd by the watch's delivery delay (milliseconds). Where an answer must hold every
member registered or gone before it was asked (an API read), `current` says whether it does:
etcd counts the member records from its index (0.5 ms at 2,000 members, against 15 ms to list
and parse them, and 5 ms for the newest record's revision, which needs a sort of them all).
The leader's rounds read the cache as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aetcd

from robustrl.contracts.members import MemberRecord
from robustrl.core.aio import cancel_and_wait
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry, member_order, parse_member
from robustrl.core.watch import Delete, Entry, Put, Resync

log = get_logger(__name__)


class MemberCache:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.revision = 0
        """The etcd revision the cache reflects (the last change it applied, or its list)."""
        self._members: dict[bytes, MemberRecord] = {}
        self._unreadable: set[bytes] = set()
        self._sorted: list[MemberRecord] | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="member-cache")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def list(self, role: str | None = None) -> tuple[list[MemberRecord], int]:
        """Live members (optionally of one role), ordered as `Registry.list` orders them, and
        the revision they reflect. Waits for the first listing only."""
        await self._ready.wait()
        if self._sorted is None:
            self._sorted = sorted(self._members.values(), key=member_order)
        members = self._sorted if role is None else [m for m in self._sorted if m.role == role]
        return list(members), self.revision

    def __len__(self) -> int:
        return len(self._members)

    async def current(self) -> bool:
        """Whether the cache holds as many member records as etcd when this was called: every
        member registered before the call, none that left before it. False when it does not
        yet (the watch has not delivered the change) or etcd could not be asked: read the
        registry itself then. A change to a record already held (a member bound to a job)
        shows once the watch delivers it."""
        await self._ready.wait()
        try:
            count = await self.registry.count()
        except aetcd.exceptions.ClientError as exc:
            log.warning("member_cache.check_failed", error=repr(exc))
            return False
        return count == len(self._members) + len(self._unreadable)

    async def _follow(self) -> None:
        while True:
            try:
                entries, revision = await self.registry.list_entries()
                break
            except Exception as exc:  # etcd away at start: the cache waits, callers with it
                log.warning("member_cache.list_failed", error=repr(exc))
                await asyncio.sleep(0.5)
        self._replace(entries, revision)
        self._ready.set()
        async for event in self.registry.watch(revision + 1):
            if isinstance(event, Put):
                self._put(event.entry)
                self.revision = event.entry.mod_revision
            elif isinstance(event, Delete):
                if self._members.pop(event.key, None) is not None:
                    self._sorted = None
                self._unreadable.discard(event.key)
                self.revision = event.revision
            elif isinstance(event, Resync):
                self._replace(event.entries, event.revision)

    def _replace(self, entries: Sequence[Entry], revision: int) -> None:
        self._members, self._unreadable = {}, set()
        for entry in entries:
            self._put(entry)
        self._sorted = None
        self.revision = revision

    def _put(self, entry: Entry) -> None:
        try:
            member = parse_member(entry)
        except ValueError:  # a record no release of ours wrote: not a member we can list
            log.warning("member_cache.unreadable_record", key=entry.key.decode(errors="replace"))
            self._unreadable.add(entry.key)
            self._members.pop(entry.key, None)
            self._sorted = None
            return
        self._unreadable.discard(entry.key)
        self._members[entry.key] = member
        self._sorted = None
