"""The roles of a robustrl stack and the kinds of incident the monitor reports.

Both are string enums: their values are what etcd records and logs carry ("rollout",
"MEMBER_LOST"), so a record written as a plain string compares equal to its member.
"""

from __future__ import annotations

import enum

from robustrl.v1 import common_pb2


class Role(enum.StrEnum):
    COORDINATOR = "coordinator"
    MONITOR = "monitor"
    TRAINER = "trainer"
    ROLLOUT = "rollout"


ROLES: tuple[str, ...] = tuple(Role)
"""Every role, in the order listings show them."""

DATA_PLANE_ROLES: tuple[str, ...] = (Role.TRAINER, Role.ROLLOUT)
"""The roles a job binds, and the only ones chaos targets and provisioners start."""

ROLE_TO_PROTO: dict[str, common_pb2.Role.ValueType] = {
    Role.COORDINATOR: common_pb2.ROLE_COORDINATOR,
    Role.MONITOR: common_pb2.ROLE_MONITOR,
    Role.TRAINER: common_pb2.ROLE_TRAINER,
    Role.ROLLOUT: common_pb2.ROLE_ROLLOUT,
}
ROLE_FROM_PROTO: dict[int, str] = {v: str(k) for k, v in ROLE_TO_PROTO.items()}


class IncidentKind(enum.StrEnum):
    """What an incident says failed (protos: `IncidentKind`, without its prefix)."""

    MEMBER_LOST = "MEMBER_LOST"
    ROLLOUT_HANG = "ROLLOUT_HANG"
    TRAINER_HANG = "TRAINER_HANG"
    COLLECTIVE_HANG = "COLLECTIVE_HANG"
    NON_FINITE = "NON_FINITE"
    DEGRADED = "DEGRADED"
    TRAINER_ERROR = "TRAINER_ERROR"

    def to_proto(self) -> common_pb2.IncidentKind.ValueType:
        return common_pb2.IncidentKind.Value(f"INCIDENT_KIND_{self.value}")


FAILURES = frozenset(
    {
        IncidentKind.MEMBER_LOST,
        IncidentKind.ROLLOUT_HANG,
        IncidentKind.TRAINER_HANG,
        IncidentKind.COLLECTIVE_HANG,
        IncidentKind.TRAINER_ERROR,
    }
)
"""The kinds that mean a member can no longer serve its job (NON_FINITE is a bad step, and
DEGRADED a warning)."""
