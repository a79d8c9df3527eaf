"""A client for the stack as the CLI (or any tool) sees it: etcd endpoints in, answers out.

It finds the coordinators in the registry and the leader in the election, sends writes to
the leader and, if leadership moved meanwhile, follows the follower's redirect once.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import grpc

from robustrl.v1 import coordinator_pb2_grpc
from services.common.channels import DEFAULT_DEADLINE, open_channel
from services.common.config import EtcdSettings
from services.common.election import current_leader
from services.common.errors import LEADER_METADATA_KEY
from services.common.etcd_client import connect_etcd
from services.common.keys import KeySpace
from services.common.registry import MemberRecord, Registry

T = TypeVar("T")
Call = Callable[[coordinator_pb2_grpc.CoordinatorStub], Awaitable[T]]


class NoCoordinator(RuntimeError):
    pass


class StackClient:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.etcd = client
        self.keys = keys
        self.registry = Registry(client, keys)

    @classmethod
    async def connect(cls, endpoints: str, prefix: str) -> StackClient:
        settings = EtcdSettings(endpoints=endpoints, prefix=prefix)
        return cls(await connect_etcd(settings), KeySpace(prefix))

    async def close(self) -> None:
        await self.etcd.close()

    async def leader(self) -> dict[str, str] | None:
        entry = await current_leader(self.etcd, self.keys.election("coordinator"))
        if entry is None:
            return None
        value: dict[str, str] = json.loads(entry.value)
        return value

    async def coordinator_addresses(self) -> list[str]:
        """Leader first, then the other replicas."""
        members, _ = await self.registry.list("coordinator")
        leader = await self.leader()
        addresses = [m.address for m in members]
        if leader and leader["address"] in addresses:
            addresses.remove(leader["address"])
            addresses.insert(0, leader["address"])
        if not addresses:
            raise NoCoordinator("no coordinator is registered in etcd; is the stack up?")
        return addresses

    async def read(self, call: Call[T]) -> T:
        """A read: any replica answers; try the next if one is unreachable."""
        addresses = await self.coordinator_addresses()
        for i, address in enumerate(addresses):
            try:
                return await _on(address, call)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(addresses) - 1:
                    raise
        raise AssertionError("unreachable")

    async def write(self, call: Call[T]) -> T:
        """A write: the leader answers; a follower's redirect is followed once."""
        address = (await self.coordinator_addresses())[0]
        try:
            return await _on(address, call)
        except grpc.aio.AioRpcError as exc:
            hint = dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY)
            if exc.code() != grpc.StatusCode.UNAVAILABLE or not hint or hint == address:
                raise
            return await _on(str(hint), call)

    async def members(self, role: str | None = None) -> list[MemberRecord]:
        members, _ = await self.registry.list(role)
        return members

    async def incidents(self, job_id: str = "") -> list[dict[str, Any]]:
        result = await self.etcd.get_prefix(self.keys.incidents())
        records = [json.loads(kv.value) for kv in result]
        return [r for r in records if not job_id or r.get("job_id") == job_id]


async def _on(address: str, call: Call[T]) -> T:
    async with open_channel(address) as channel:
        return await call(coordinator_pb2_grpc.CoordinatorStub(channel))


__all__ = ["DEFAULT_DEADLINE", "NoCoordinator", "StackClient"]
