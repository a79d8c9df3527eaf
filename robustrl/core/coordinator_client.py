"""Calling the coordinator from anywhere: find the replicas in etcd, send writes to the
leader, and follow a follower's redirect once if leadership moved meanwhile.

Writes are a data-plane hot path (every lease, completion and progress report), so the
client remembers the leader's address and keeps a channel to it; it looks in etcd again
only after the leader stops answering."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import grpc

from robustrl.contracts.errors import LEADER_METADATA_KEY, Unavailable
from robustrl.contracts.keys import KeySpace
from robustrl.core.aio import retry_while
from robustrl.core.channels import open_channel
from robustrl.core.election import current_leader
from robustrl.core.etcd_client import ETCD_UNREACHABLE
from robustrl.core.registry import Registry
from robustrl.v1 import coordinator_pb2_grpc

T = TypeVar("T")
Call = Callable[[coordinator_pb2_grpc.CoordinatorStub], Awaitable[T]]

NO_LEADER_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Statuses a write is sent again after: no leader, or none in time."""


def unanswered(exc: BaseException, codes: frozenset[grpc.StatusCode]) -> bool:
    """No coordinator answered, for now: a gRPC status in `codes`, or none to be found in
    etcd (`addresses` raised Unavailable). Worth trying again."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in codes
    return isinstance(exc, Unavailable)


class CoordinatorClient:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.etcd = client
        self.keys = keys
        self.registry = Registry(client, keys)
        self._leader_address: str | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def leader(self) -> dict[str, str] | None:
        """{instance_id, address} of the leading replica, or None."""
        entry = await current_leader(self.etcd, self.keys.election("coordinator"))
        if entry is None:
            return None
        value: dict[str, str] = json.loads(entry.value)
        return value

    async def addresses(self) -> list[str]:
        """Every registered replica, the leader first. Unavailable (which every caller rides
        out) when there is none, or when etcd, where they are found, is unreachable."""
        try:
            members, _ = await self.registry.list("coordinator")
            leader = await self.leader()
        except ETCD_UNREACHABLE as exc:
            raise Unavailable(f"cannot look up the coordinator: etcd unreachable ({exc})") from exc
        addresses = [m.address for m in members]
        if leader and leader["address"] in addresses:
            addresses.remove(leader["address"])
            addresses.insert(0, leader["address"])
        if not addresses:
            raise Unavailable("no coordinator is registered in etcd; is the stack up?")
        return addresses

    async def read(self, call: Call[T]) -> T:
        """Any replica answers reads; an unreachable one is skipped."""
        addresses = await self.addresses()
        for i, address in enumerate(addresses):
            try:
                return await _on(address, call)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(addresses) - 1:
                    raise
        raise AssertionError("unreachable")

    async def write(self, call: Call[T]) -> T:
        """The leader answers writes; a follower's redirect is followed once."""
        address = self._leader_address or (await self.addresses())[0]
        try:
            return await self._on_leader(address, call)
        except grpc.aio.AioRpcError as exc:
            hint = dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY)
            if exc.code() != grpc.StatusCode.UNAVAILABLE or not hint or hint == address:
                raise
            return await self._on_leader(str(hint), call)

    async def write_until_answered(
        self,
        call: Call[T],
        *,
        retried: frozenset[grpc.StatusCode] = NO_LEADER_ANSWER,
        on_wait: Callable[[], None] | None = None,
        **context: Any,
    ) -> T:
        """`write`, sent again for as long as no leader answers it (`retry_while`): during a
        failover (the new leader is at another address, which only a fresh look in etcd
        finds) and while etcd is unreachable (the leader can write nothing, and nobody can
        look it up). An answer with a status not in `retried` is raised. Logs
        `coordinator.unanswered` once and `coordinator.answered` with the wait.

        A write that timed out may have been applied: its caller must be one the coordinator
        ignores when sent again (completions and progress reports are)."""
        return await retry_while(
            lambda: self.write(call),
            lambda exc: unanswered(exc, retried),
            waiting="coordinator.unanswered",
            answered="coordinator.answered",
            on_wait=on_wait,
            **context,
        )

    async def _on_leader(self, address: str, call: Call[T]) -> T:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address)
        try:
            result = await call(coordinator_pb2_grpc.CoordinatorStub(channel))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # Not (or no longer) the leader, or gone: find it in etcd next time.
                self._leader_address = None
                await self._channels.pop(address).close()
            raise
        self._leader_address = address
        return result

    async def close_channels(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._leader_address = None
        for channel in channels:
            await channel.close()


async def _on(address: str, call: Call[T]) -> T:
    async with open_channel(address) as channel:
        return await call(coordinator_pb2_grpc.CoordinatorStub(channel))
