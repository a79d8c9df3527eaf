"""The Provisioning stream (the `external` provisioner) against real coordinator replicas:
who may open it, and the codes for a bad hello or report. The requests themselves, end to
end with a real scheduler process, are in tests/chaos/test_recovery.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from robustrl.contracts.errors import LEADER_METADATA_KEY
from robustrl.contracts.provisioning import ACCEPTED_METADATA_KEY
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import common_pb2, provisioning_pb2, provisioning_pb2_grpc

Message = provisioning_pb2.ProvisionerMessage


def hello(name: str, *roles: common_pb2.Role.ValueType) -> Message:
    return Message(hello=provisioning_pb2.ProvisionerHello(name=name, roles=roles))


def report(request_id: str) -> Message:
    return Message(report=provisioning_pb2.ProvisionReport(request_id=request_id, ok=True))


async def refusal(runtime: ServiceRuntime, messages: Sequence[Message]) -> grpc.aio.AioRpcError:
    """Open the stream and send `messages`: the error the coordinator ends the stream with."""

    async def send() -> AsyncIterator[Message]:
        for message in messages:
            yield message

    async with grpc.aio.insecure_channel(runtime.address) as channel:
        call = provisioning_pb2_grpc.ProvisioningStub(channel).Provision(send(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    return info.value


async def test_a_coordinator_with_the_local_provisioner_refuses_a_scheduler(
    coordinators: list[ServiceRuntime],
) -> None:
    refused = await refusal(coordinators[0], [hello("slurm")])
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ROBUSTRL_COORDINATOR_PROVISIONER=external" in (refused.details() or "")


async def test_bad_hellos_and_reports_get_the_right_code(
    external_coordinators: list[ServiceRuntime],
) -> None:
    leader, follower = external_coordinators
    cases = [
        ([report("r1")], grpc.StatusCode.INVALID_ARGUMENT, "first message"),
        ([hello("")], grpc.StatusCode.INVALID_ARGUMENT, "must name"),
        ([hello("k8s", common_pb2.ROLE_MONITOR)], grpc.StatusCode.INVALID_ARGUMENT, "only"),
        ([hello("k8s"), hello("k8s")], grpc.StatusCode.INVALID_ARGUMENT, "only reports"),
        ([hello("k8s"), report("prov-nope")], grpc.StatusCode.NOT_FOUND, "prov-nope"),
    ]
    for messages, code, words in cases:
        refused = await refusal(leader, messages)
        assert refused.code() == code, (messages, refused)
        assert words in (refused.details() or ""), refused.details()
    refused = await refusal(follower, [hello("k8s")])
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "not the leader" in (refused.details() or "")
    assert dict(refused.trailing_metadata() or ()).get(LEADER_METADATA_KEY) == leader.address


async def test_a_second_scheduler_under_a_connected_name_is_refused(
    external_coordinators: list[ServiceRuntime],
) -> None:
    leader = external_coordinators[0]
    release = asyncio.Event()

    async def send() -> AsyncIterator[Message]:
        yield hello("slurm")
        await release.wait()

    async with grpc.aio.insecure_channel(leader.address) as channel:
        first = provisioning_pb2_grpc.ProvisioningStub(channel).Provision(send(), timeout=10)
        accepted = dict(await first.initial_metadata() or ())
        assert accepted.get(ACCEPTED_METADATA_KEY) == "slurm"
        refused = await refusal(leader, [hello("slurm")])
        release.set()
        first.cancel()
    assert refused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already connected" in (refused.details() or "")
