"""Membership: who is alive, in what role, at which address — kept in etcd under leases.

Every service registers itself once its server is up; the record lives under the service's
session lease, so a crashed process drops out of the registry within the lease TTL and a
clean shutdown (which revokes the lease) drops out at once. Nobody is configured with
another service's address: they list or watch the registry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import aetcd
import aetcd.rpc
import aetcd.utils
import grpc

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.contracts.roles import ROLES
from robustrl.core.session import lease_gone
from robustrl.core.watch import Entry, WatchEvent, list_prefix, watch_prefix


def parse_member(entry: Entry) -> MemberRecord:
    return MemberRecord.model_validate_json(entry.value)


def member_order(member: MemberRecord) -> tuple[int, str]:
    """How members are listed: by role (in `ROLES` order), then by instance id."""
    return (ROLES.index(member.role) if member.role in ROLES else 99, member.instance_id)


class Leased(Protocol):
    """What a registration is written under: a Session, or anything else holding a lease."""

    @property
    def lease_id(self) -> int: ...


class LeaseGone(Exception):
    """A registration was written under a lease that etcd no longer has."""


class Registry:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys

    async def register(self, session: Leased, member: MemberRecord) -> MemberRecord:
        """Write (or rewrite) the member's record under the session's lease. LeaseGone if the
        lease expired already (its keepalive may not have noticed yet)."""
        member = member.model_copy(update={"lease_id": session.lease_id})
        key = self.keys.member(member.role, member.instance_id)
        try:
            await self.client.put(key, member.model_dump_json().encode(), lease=session.lease_id)
        except aetcd.exceptions.ClientError as exc:
            if lease_gone(exc):
                raise LeaseGone(f"lease {session.lease_id:x} expired") from exc
            raise
        return member

    async def deregister(self, member: MemberRecord) -> None:
        await self.client.delete(self.keys.member(member.role, member.instance_id))

    async def list_entries(self) -> tuple[list[Entry], int]:
        """Every member's record as stored, unparsed, and the revision they were read at."""
        return await list_prefix(self.client, self.keys.members())

    async def count(self) -> int:
        """How many member records there are, without reading them: etcd counts its index."""
        prefix = self.keys.members()
        request = aetcd.rpc.RangeRequest(
            key=prefix, range_end=aetcd.utils.prefix_range_end(prefix), count_only=True
        )
        # aetcd's own calls have no count-only range; its stub, metadata and timeout do.
        try:
            reply = await self.client.kvstub.Range(
                request, timeout=self.client._timeout, metadata=self.client.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise aetcd.exceptions.ClientError(f"etcd: {exc.code().name}") from exc
        return int(reply.count)

    async def list(self, role: str | None = None) -> tuple[list[MemberRecord], int]:
        """Live members (optionally of one role) and the revision they were read at."""
        entries, revision = await list_prefix(self.client, self.keys.members(role))
        members = [parse_member(e) for e in entries]
        members.sort(key=member_order)
        return members, revision

    async def get(self, role: str, instance_id: str) -> MemberRecord | None:
        result = await self.client.get(self.keys.member(role, instance_id))
        return None if result is None else MemberRecord.model_validate_json(result.value)

    def watch(self, start_revision: int, role: str | None = None) -> AsyncIterator[WatchEvent]:
        """Membership changes from start_revision on; a Resync after compaction."""
        return watch_prefix(self.client, self.keys.members(role), start_revision)

    def role_and_instance(self, key: bytes) -> tuple[str, str]:
        """Split a member key back into (role, instance_id)."""
        rest = key.decode().removeprefix(self.keys.members().decode())
        role, _, instance_id = rest.partition("/")
        return role, instance_id
