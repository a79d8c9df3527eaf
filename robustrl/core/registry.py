"""Membership: who is alive, in what role, at which address — kept in etcd under leases.

Every service registers itself once its server is up; the record lives under the service's
session lease, so a crashed process drops out of the registry within the lease TTL and a
clean shutdown (which revokes the lease) drops out at once. Nobody is configured with
another service's address: they list or watch the registry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aetcd

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.contracts.roles import ROLES
from robustrl.core.session import Session, lease_gone
from robustrl.core.watch import Entry, WatchEvent, list_prefix, watch_prefix


def parse_member(entry: Entry) -> MemberRecord:
    return MemberRecord.model_validate_json(entry.value)


class LeaseGone(Exception):
    """A registration was written under a lease that etcd no longer has."""


class Registry:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys

    async def register(self, session: Session, member: MemberRecord) -> MemberRecord:
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

    async def list(self, role: str | None = None) -> tuple[list[MemberRecord], int]:
        """Live members (optionally of one role) and the revision they were read at."""
        entries, revision = await list_prefix(self.client, self.keys.members(role))
        members = [parse_member(e) for e in entries]
        members.sort(key=lambda m: (ROLES.index(m.role) if m.role in ROLES else 99, m.instance_id))
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
