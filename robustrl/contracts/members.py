"""A member of the stack as the registry stores it in etcd, and as the API shows it."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from robustrl.contracts.roles import ROLE_TO_PROTO
from robustrl.v1 import common_pb2

ENGINE_PID_LABEL = "engine_pid"
"""Registry label of a rollout whose inference engine runs in a process of its own (vLLM's
engine core): that process's id, for tools that act on the engine alone (`robustrl chaos`)."""


RANK_LABEL = "rank"
"""The label of a trainer's rank (1..) in its job's group; the bound trainer has none."""


class MemberRecord(BaseModel):
    """A member as stored in etcd (JSON)."""

    # Values are not kept in pydantic's process-wide string cache: ids and addresses of
    # members long gone would stay there, and pin the memory of their time (decision 0019).
    model_config = ConfigDict(cache_strings="keys")

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


def member_rank(member: MemberRecord) -> int | None:
    """A trainer's rank in its job's trainer group (ranks 1.. are labelled; the bound trainer
    is rank 0); None for a member that is not a bound trainer."""
    if member.role != "trainer" or not member.job_id:
        return None
    return int(member.labels.get(RANK_LABEL, "0"))


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
