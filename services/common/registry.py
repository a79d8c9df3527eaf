"""Membership: who is alive, in what role, at which address — kept in etcd under leases.

Every service registers itself once its server is up; the record lives under the service's
session lease, so a crashed process drops out of the registry within the lease TTL and a
clean shutdown (which revokes the lease) drops out at once. Nobody is configured with
another service's address: they list or watch the registry.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aetcd
from pydantic import BaseModel, Field

from robustrl.v1 import common_pb2
from services.common.keys import KeySpace
from services.common.session import Session, lease_gone
from services.common.watch import Entry, WatchEvent, list_prefix, watch_prefix

ROLES = ("coordinator", "monitor", "trainer", "rollout")
DATA_PLANE_ROLES = ("trainer", "rollout")
"""The roles a job binds, and the only ones chaos targets and provisioners start."""

ROLE_TO_PROTO: dict[str, common_pb2.Role.ValueType] = {
    "coordinator": common_pb2.ROLE_COORDINATOR,
    "monitor": common_pb2.ROLE_MONITOR,
    "trainer": common_pb2.ROLE_TRAINER,
    "rollout": common_pb2.ROLE_ROLLOUT,
}
ROLE_FROM_PROTO = {v: k for k, v in ROLE_TO_PROTO.items()}


class MemberRecord(BaseModel):
    """A member as stored in etcd (JSON)."""

    role: str
    instance_id: str
    address: str
    pid: int
    host: str
    epoch: int = 0
    lease_id: int = 0
    job_id: str = ""
    registered_at: float = Field(default_factory=time.time)
    labels: dict[str, str] = Field(default_factory=dict)

    def changed(
        self, labels: dict[str, str | None] | None = None, **fields: object
    ) -> MemberRecord:
        """A copy with `fields` replaced (job_id, epoch) and `labels` merged into the labels
        (a label set to None is removed)."""
        if labels:
            merged = {**self.labels, **labels}
            fields["labels"] = {name: value for name, value in merged.items() if value is not None}
        return self.model_copy(update=fields)


def member_to_proto(member: MemberRecord, *, leader: bool = False) -> common_pb2.Member:
    out = common_pb2.Member(
        role=ROLE_TO_PROTO.get(member.role, common_pb2.ROLE_UNSPECIFIED),
        instance_id=member.instance_id,
        address=member.address,
        pid=member.pid,
        host=member.host,
        epoch=member.epoch,
        lease_id=member.lease_id,
        job_id=member.job_id,
        leader=leader,
    )
    out.registered_at.FromNanoseconds(int(member.registered_at * 1e9))
    out.labels.update(member.labels)
    return out


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
