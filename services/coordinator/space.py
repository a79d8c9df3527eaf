"""The leader gets etcd out of NOSPACE by itself.

etcd refuses every write once its database file reaches its quota (the NOSPACE alarm): no
lease, completion, step or heartbeat record lands, and every job stops where it is.
Compaction (the local stack keeps `stack.ETCD_HISTORY_RETENTION` of history) only frees pages
inside the file; the file shrinks and the alarm goes only once every member has been
defragmented and the alarm disarmed, which etcd leaves to a person. The leader does it when it
sees the alarm (`SpaceKeeper.keep`, from its supervision rounds): compact the history to the
current revision, defragment each member in turn over the client address it advertises (once
that member has deleted the compacted history; a member is blocked while it defragments:
seconds for a file of hundreds of MB), then disarm.
Watches that were behind the compacted revision resync from the current state (watch.py).

etcd grants no lease under NOSPACE, so a service that starts then cannot register, and a
coordinator replica cannot campaign: if every replica restarted while etcd was full, none
could lead to free it. So a replica frees it at start too, before it registers
(`ServiceRuntime.start`'s `free_space`, this keeper's `keep`), and other services wait there.

When the live data itself is near the quota, disarming only brings the alarm back. If the alarm
returns within twice the gap after a recovery, the gap before the next one doubles (from
`min_gap`, up to `max_gap`) and the log says what a person has to do: raise etcd's
--quota-backend-bytes or delete ended jobs (`robustrl delete`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd
from aetcd import rpc

from robustrl.core.config import EtcdSettings
from robustrl.core.logs import get_logger

log = get_logger("coordinator")

MB = 1e6


@dataclass(frozen=True)
class SpaceRecovery:
    revision: int
    """The revision the history was compacted to."""
    db_bytes_before: int
    db_bytes_after: int
    """The largest member's database file, before and after (after: about the live data)."""
    seconds: float


class SpaceKeeper:
    def __init__(
        self,
        client: Callable[[], aetcd.Client | None],
        settings: EtcdSettings,
        *,
        check_every: float = 5.0,
        min_gap: float = 60.0,
        max_gap: float = 3600.0,
        defrag_timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`client`: the leader's etcd client, read at each check (it changes on reconnect;
        None while there is none).
        Each member is defragmented over a client of its own with `defrag_timeout`: the
        leader's requests have a deadline of a few seconds, and a defragment takes longer."""
        self._client_of = client
        self.settings = settings
        self.check_every = check_every
        self.min_gap = min_gap
        self.max_gap = max_gap
        self.defrag_timeout = defrag_timeout
        self.clock = clock
        self.gap = min_gap
        self.recoveries = 0
        self._next_check = 0.0
        self._last_recovery: float | None = None
        self._waiting_logged = False

    async def keep(self) -> SpaceRecovery | None:
        """Recover etcd if it raised NOSPACE and the gap since the last recovery has passed;
        checks at most every `check_every` seconds. The recovery, if one was made."""
        now = self.clock()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_every
        if not await nospace_members(self._client()):
            self._waiting_logged = False
            return None
        if self._last_recovery is not None and now < self._last_recovery + self.gap:
            if not self._waiting_logged:
                log.error(
                    "etcd.space_recovery_waiting",
                    since_last_s=round(now - self._last_recovery, 1),
                    next_in_s=round(self._last_recovery + self.gap - now, 1),
                    advice=ADVICE,
                )
                self._waiting_logged = True
            return None
        if self._last_recovery is not None and now < self._last_recovery + 2 * self.gap:
            self.gap = min(2 * self.gap, self.max_gap)
            log.error(
                "etcd.space_refilled",
                since_last_s=round(now - self._last_recovery, 1),
                next_gap_s=self.gap,
                advice=ADVICE,
            )
        else:
            self.gap = self.min_gap
        self._last_recovery = now
        self._waiting_logged = False
        recovery = await self.recover()
        log.warning(
            "etcd.space_recovered",
            revision=recovery.revision,
            db_mb_before=round(recovery.db_bytes_before / MB, 1),
            db_mb_after=round(recovery.db_bytes_after / MB, 1),
            seconds=round(recovery.seconds, 2),
        )
        return recovery

    async def recover(self) -> SpaceRecovery:
        """Compact to the current revision, defragment every member, disarm NOSPACE."""
        started = time.perf_counter()
        client = self._client()
        revision = int((await client.get_prefix(b"\0")).header.revision)
        members = await self._members(client)
        before = await self._db_bytes(members)
        await _compact(client, revision)
        after = []
        for host, port in members:
            async with _member_client(host, port, self.defrag_timeout) as member:
                await _compact(member, revision)  # this member has deleted the history too
                await member.defragment()
                after.append((await member.status()).db_size)
        # One deactivation per member that raised it: etcd matches the member id exactly (0,
        # which the client offers for "every member", disarms nothing).
        for member_id in await nospace_members(client):
            await client.disarm_alarm(member_id)
        self.recoveries += 1
        return SpaceRecovery(revision, before, max(after), time.perf_counter() - started)

    def _client(self) -> aetcd.Client:
        client = self._client_of()
        if client is None:
            raise RuntimeError("not connected to etcd")
        return client

    async def _members(self, client: aetcd.Client) -> list[tuple[str, int]]:
        """Each member's own client endpoint, as it advertises it: the endpoints we were given
        may be one name in front of several members (a Kubernetes service), and a defragment
        reaches only the member that answers it."""
        found = []
        async for member in client.members():
            for url in member.client_urls[:1]:
                parts = urlsplit(url)
                if parts.hostname and parts.port:
                    found.append((parts.hostname, parts.port))
        return found or self.settings.endpoint_list()

    async def _db_bytes(self, members: list[tuple[str, int]]) -> int:
        sizes = []
        for host, port in members:
            try:
                async with _member_client(host, port, self.settings.timeout) as member:
                    sizes.append((await member.status()).db_size)
            except aetcd.exceptions.ClientError:
                continue  # a member that does not answer is not defragmented either: it fails
        return max(sizes, default=0)


async def _compact(client: aetcd.Client, revision: int) -> None:
    """Compact the history to `revision`, and wait until the member `client` talks to has
    deleted it from its file. Each member deletes on its own time, after it applies the
    compaction: a follower defragmented before that keeps its whole file (seen in CI). Asked
    again of a member, etcd answers "compacted" only once that member's earlier deletions are
    done, so asking each member before its defragment waits for exactly that."""
    try:
        await client.compact(revision, physical=True)
    except aetcd.exceptions.ClientError as exc:
        if "compacted" not in str(exc):  # compacted already (by us, or since): fine
            raise


async def nospace_members(client: aetcd.Client) -> set[int]:
    """The ids of the members that raised NOSPACE (empty: etcd takes writes)."""
    return {a.member_id async for a in client.list_alarms() if a.alarm_type == rpc.NOSPACE}


@contextlib.asynccontextmanager
async def _member_client(host: str, port: int, timeout: float) -> AsyncIterator[aetcd.Client]:
    """A client of one member's own, closed on the way out."""
    client = aetcd.Client(host=host, port=port, timeout=int(max(1, timeout)))
    try:
        yield client
    finally:
        await client.close()


ADVICE = (
    "etcd's live data is near its quota: raise etcd's --quota-backend-bytes, or delete "
    "ended jobs (robustrl delete JOB)"
)
