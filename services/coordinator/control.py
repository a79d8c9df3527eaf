"""Control RPCs from the leader to a trainer or rollout: BIND, RELEASE, FENCE, PREPARE."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from robustrl.contracts.members import MemberRecord
from robustrl.core.channels import open_channel
from robustrl.core.logs import get_logger
from robustrl.v1 import rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = get_logger(__name__)

Action: TypeAlias = trainer_pb2.ControlRequest.Action.ValueType

BIND = trainer_pb2.ControlRequest.ACTION_BIND
RELEASE = trainer_pb2.ControlRequest.ACTION_RELEASE
FENCE = trainer_pb2.ControlRequest.ACTION_FENCE
PREPARE = trainer_pb2.ControlRequest.ACTION_PREPARE

CONTROL_DEADLINE = 30.0
"""Seconds a member gets to accept a BIND (it loads the model before answering)."""


async def control(
    member: MemberRecord,
    action: Action,
    job_id: str,
    epoch: int,
    args: dict[str, str] | None = None,
    *,
    timeout: float = CONTROL_DEADLINE,
) -> None:
    """Send `action` to the member; its refusal raises grpc.aio.AioRpcError."""
    request = trainer_pb2.ControlRequest(action=action, job_id=job_id, epoch=epoch, args=args or {})
    async with open_channel(member.address) as channel:
        if member.role == "trainer":
            await trainer_pb2_grpc.TrainerStub(channel).Control(request, timeout=timeout)
        else:
            await rollout_pb2_grpc.RolloutStub(channel).Control(request, timeout=timeout)


async def control_quietly(
    member: MemberRecord,
    action: Action,
    job_id: str,
    epoch: int,
    args: dict[str, str] | None = None,
) -> None:
    """`control`, for a member that may be gone: a refusal is logged, not raised."""
    try:
        await control(member, action, job_id, epoch, args)
    except grpc.aio.AioRpcError as exc:
        log.info("coordinator.control_failed", member=member.instance_id, error=exc.details())
