"""Leadership of the coordinator replicas: campaign, lead, step down on session loss.

One replica leads (etcd election); followers serve reads and answer writes with the
leader's address. Leading means nothing is cached that etcd does not hold: a new leader
reloads every job from etcd before it acts, and each leader-only write carries a guard that
fails if this replica has lost the election.

The replica next in line checks the leader's address while it waits: refused twice in a row
(the process is dead: kill -9, a crash), it revokes the leader's lease and leads within about a
second instead of the session TTL. A leader that does not answer at all (a hang, a
partition, a machine gone) keeps its lease until the lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from robustrl.contracts.errors import NotLeader, Unavailable
from robustrl.core.aio import cancel_and_wait
from robustrl.core.channels import refuses_connections
from robustrl.core.election import Election, current_leader
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from robustrl.core.session import Session
from robustrl.core.watch import Entry

log = get_logger(__name__)

REFUSALS_FOR_GONE = 2
"""Refused connections in a row to the leader's address that make it gone for certain."""
CONNECT_TIMEOUT = 1.0


class Leadership:
    def __init__(
        self,
        runtime: ServiceRuntime,
        election_name: str,
        on_elected: Callable[[], Awaitable[None]],
    ) -> None:
        self.runtime = runtime
        self.prefix = runtime.keys.election(election_name)
        self.on_elected = on_elected
        self.election: Election | None = None
        self.is_leader = False
        self._task: asyncio.Task[None] | None = None
        self._refused: dict[bytes, int] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="leadership")

    def _value(self) -> bytes:
        return json.dumps(
            {"instance_id": self.runtime.instance_id, "address": self.runtime.address}
        ).encode()

    async def _run(self) -> None:
        session: Session | None = None
        while True:
            session = await self.runtime.next_session(session)
            assert self.runtime.client is not None
            election = Election(self.runtime.client, self.prefix, session, gone=self._leader_gone)
            self.election = election
            try:
                await election.campaign(self._value())
            except RuntimeError as exc:  # session lost while campaigning: start over
                log.info("coordinator.campaign_restart", reason=str(exc))
                continue
            except Exception as exc:  # etcd away: wait for the runtime's next session
                log.warning("coordinator.campaign_failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            try:
                await self.on_elected()
            except Exception as exc:  # could not take over (etcd away?): let another replica try
                log.warning("coordinator.takeover_failed", error=repr(exc))
                with contextlib.suppress(Exception):
                    await election.resign()
                await asyncio.sleep(0.5)
                continue
            self.is_leader = True
            log.info("coordinator.elected")
            try:
                await session.done.wait()
            finally:
                self.is_leader = False
                log.warning("coordinator.deposed")

    async def _leader_gone(self, leader: Entry) -> bool:
        """Whether the leader's address refused a connection `REFUSALS_FOR_GONE` times in a
        row: nothing listens there, so its process is dead. An accepted connection, a timeout
        or any other error proves nothing and starts the count again."""
        address = str(json.loads(leader.value).get("address", ""))
        if not await refuses_connections(address, CONNECT_TIMEOUT):
            self._refused.pop(leader.key, None)
            return False
        refused = self._refused.pop(leader.key, 0) + 1
        if refused < REFUSALS_FOR_GONE:
            self._refused[leader.key] = refused
        return refused >= REFUSALS_FOR_GONE

    def guard(self) -> list[Any]:
        """etcd comparisons that make a write conditional on still leading; NotLeader if not."""
        if not self.is_leader or self.election is None:
            raise NotLeader(None)
        return [self.election.leader_guard()]

    async def leader(self) -> dict[str, str] | None:
        """{instance_id, address} of the current leader, or None."""
        assert self.runtime.client is not None
        entry = await current_leader(self.runtime.client, self.prefix)
        if entry is None:
            return None
        value: dict[str, str] = json.loads(entry.value)
        return value

    async def require_leader(self) -> list[Any]:
        """The write guard, or NotLeader naming the leader's address for the client to retry."""
        if self.is_leader:
            return self.guard()
        leader = await self.leader()
        if leader is not None and leader["instance_id"] == self.runtime.instance_id:
            raise Unavailable(
                "this coordinator won the election and is reloading state from etcd; "
                "retry in a moment"
            )
        raise NotLeader(leader["address"] if leader else None)

    async def resign(self) -> None:
        await cancel_and_wait(self._task)
        if self.election is not None and self.is_leader:
            with contextlib.suppress(Exception):
                await self.election.resign()
        self.is_leader = False
