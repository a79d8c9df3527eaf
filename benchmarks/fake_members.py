"""The fake rollout members of benchmarks/control_plane.py, run in its child processes.

A fake member is what the control plane sees of a real one, and nothing more: its own etcd
lease and MemberRecord under it (registered again under a new lease if the old one is lost,
as ServiceRuntime does, and counted), its own heartbeat stream (HeartbeatSender) with 16
rising counters, idle (no request in flight), and its own gRPC server on its own port
answering health checks and the Rollout service's Probe (progressing).

Each member's lease is its own, but a child refreshes all of its leases over one keepalive
stream, as etcd's protocol allows: aetcd opens a stream for every refresh, and 2,000 members
refreshing their leases that way took the generator about half a core on their own and, on
two busy cores, fell behind until leases lapsed by the thousand. A real member refreshes one
lease from a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import aetcd.rpc
import grpc
from grpc_health.v1 import health, health_pb2_grpc

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.contracts.roles import ROLE_TO_PROTO
from robustrl.core.aio import cancel_and_wait
from robustrl.core.config import EtcdSettings
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.heartbeat import HeartbeatSender, Progress
from robustrl.core.logs import configure_logging
from robustrl.core.registry import Registry
from robustrl.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2

FAKE = "fake-rollout-"
GROW_AT_ONCE = 64
"""Members one generator process starts at once (each grants a lease and writes its record)."""
TOKENS_PER_S = 40.0


def member_id(index: int) -> str:
    return f"{FAKE}{index:05d}"


class Lease:
    """A member's lease, refreshed by its generator's `Leases`; what Registry.register needs of
    a Session (`lease_id`), and `done` once it is lost."""

    def __init__(self, lease_id: int, leases: Leases) -> None:
        self.lease_id = lease_id
        self.done = asyncio.Event()
        self._leases = leases

    async def detach(self) -> None:
        """No more refreshes: the lease runs out by its TTL (a killed process)."""
        self._leases.live.pop(self.lease_id, None)

    async def close(self) -> None:
        """Revoked: its keys go at once (a clean stop). A lease lost meanwhile has no keys."""
        await self.detach()
        try:
            await self._leases.client.revoke_lease(self.lease_id)
        except aetcd.exceptions.ClientError as exc:
            if "not found" not in str(exc):
                raise


class Leases:
    """Every lease of one generator process, refreshed at a third of the TTL over one stream."""

    def __init__(self, client: aetcd.Client, ttl: int) -> None:
        self.client = client
        self.ttl = ttl
        self.live: dict[int, Lease] = {}

    async def grant(self) -> Lease:
        granted = await self.client.lease(self.ttl)
        lease = self.live[granted.id] = Lease(granted.id, self)
        return lease

    async def keep(self) -> None:
        while True:
            call = self.client.leasestub.LeaseKeepAlive(metadata=self.client.metadata)
            # Replies are read as they come: unread, they fill the stream's window and etcd
            # stops taking requests (at about 2,000 leases a round).
            reader = asyncio.create_task(self._replies(call))
            try:
                while True:
                    began = time.monotonic()
                    for lease_id in list(self.live):
                        await call.write(aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
                    if reader.done():
                        reader.result()
                    await asyncio.sleep(max(0.0, self.ttl / 3 - (time.monotonic() - began)))
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)  # etcd away: a new stream, as a member's session does
            finally:
                await cancel_and_wait(reader)

    async def _replies(self, call: Any) -> None:
        async for reply in call:
            if reply.TTL <= 0 and (lost := self.live.pop(reply.ID, None)):
                lost.done.set()


class Probe(rollout_pb2_grpc.RolloutServicer):
    """A fake member is idle: progressing, at once (as a real rollout with no request)."""

    async def Probe(
        self, request: rollout_pb2.ProbeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ProbeResponse:
        return rollout_pb2.ProbeResponse(progressing=True, detail="idle: fake member")

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.RoleStatus:
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("a fake member has no status")
        return trainer_pb2.RoleStatus()

    async def Control(
        self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ControlResponse:
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("a fake member takes no job")
        return trainer_pb2.ControlResponse()


class FakeMember:
    """One fake rollout: server, lease, record and heartbeat stream, as a real member has."""

    def __init__(self, index: int) -> None:
        self.instance_id = member_id(index)
        self.server: grpc.aio.Server | None = None
        self.session: Lease | None = None
        self.sender: HeartbeatSender | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.counters: dict[str, float] = {}

    async def start(self, gen: Generator) -> None:
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(gen.health, self.server)
        rollout_pb2_grpc.add_RolloutServicer_to_server(gen.probe, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.session = await gen.leases.grant()
        record = MemberRecord(
            role="rollout",
            instance_id=self.instance_id,
            address=f"127.0.0.1:{port}",
            pid=os.getpid(),
            host=socket.gethostname(),
        )
        await gen.registry.register(self.session, record)
        self.keeper = asyncio.create_task(self.keep_registered(gen, record))
        self.counters = {
            "tokens_generated": 0.0,
            "tokens_per_s": TOKENS_PER_S,
            "requests_in_flight": 0.0,
            "groups_completed": 0.0,
            **{f"fake_counter_{n:02d}": 0.0 for n in range(12)},
        }
        progress = Progress(counters=self.counters)
        self.sender = HeartbeatSender(
            gen.registry,
            role=ROLE_TO_PROTO["rollout"],
            instance_id=self.instance_id,
            progress=progress,
            interval=gen.beat,
        )
        self.sender.start()

    async def keep_registered(self, gen: Generator, record: MemberRecord) -> None:
        """As ServiceRuntime does: a lease lost (not refreshed within its TTL: the generator's
        loop or etcd too busy) is counted, and the member registers again under a new one."""
        while True:
            assert self.session is not None
            await self.session.done.wait()
            gen.leases_lost += 1
            while True:
                try:
                    self.session = await gen.leases.grant()
                    await gen.registry.register(self.session, record)
                    break
                except Exception:  # etcd still away: try again, as a member does
                    await asyncio.sleep(0.5)

    async def die(self) -> float:
        """As a kill -9 looks from outside: the address refuses, the stream is cut without a
        goodbye (the sender's task cancelled: its channel closes) and the lease is left to
        expire (not revoked). The listener goes first: a killed process loses its sockets
        together, and a stream cut while its listener still accepts (by as long as a busy
        loop takes to close it) would look like a process still dying, which it is not.
        When it died: once its listener is closed, as its stream is cut."""
        assert self.server and self.session and self.sender and self.sender._task
        await cancel_and_wait(self.keeper)
        await self.server.stop(None)
        died = time.time()
        self.sender._task.cancel()  # no public way to stop without the goodbye stop() sends
        await self.session.detach()
        return died

    async def leave(self) -> None:
        """A clean stop: goodbye, lease revoked, server closed."""
        assert self.server and self.session and self.sender
        await cancel_and_wait(self.keeper)
        await self.sender.stop()
        await self.session.close()
        await self.server.stop(None)


class Generator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ttl: int = args.ttl
        self.beat: float = args.beat
        self.members: dict[int, FakeMember] = {}
        self.leases_lost = 0
        self.lag_max = 0.0
        """The longest its event loop was late for a tick since the last `status`."""
        self.health = health.aio.HealthServicer()  # serves "" as SERVING; shared by all
        self.probe = Probe()

    async def open(self) -> None:
        configure_logging(service="bench", instance=f"generator-{self.args.child}", level="error")
        settings = EtcdSettings(endpoints=self.args.endpoints, prefix=self.args.prefix)
        self.client = await connect_etcd(settings)
        self.registry = Registry(self.client, KeySpace(self.args.prefix))
        self.leases = Leases(self.client, self.ttl)

    async def grow(self, indices: list[int]) -> dict[str, Any]:
        began = time.monotonic()
        gate = asyncio.Semaphore(GROW_AT_ONCE)

        async def one(index: int) -> None:
            async with gate:
                member = FakeMember(index)
                await member.start(self)
                self.members[index] = member

        await asyncio.gather(*(one(i) for i in indices if i not in self.members))
        return {"members": len(self.members), "seconds": time.monotonic() - began}

    async def tick(self) -> None:
        """Every beat, every member's counters rise (tokens steadily, the rest by one)."""
        while True:
            began = time.monotonic()
            await asyncio.sleep(self.beat)
            self.lag_max = max(self.lag_max, time.monotonic() - began - self.beat)
            for member in self.members.values():
                for name, value in member.counters.items():
                    if name == "tokens_generated":
                        member.counters[name] = value + TOKENS_PER_S * self.beat
                    elif name not in ("tokens_per_s", "requests_in_flight"):
                        member.counters[name] = value + 1

    async def status(self) -> dict[str, Any]:
        lag, self.lag_max = self.lag_max, 0.0
        return {"leases_lost": self.leases_lost, "lag_max_s": lag}

    async def kill(self, indices: list[int]) -> dict[str, Any]:
        victims = [self.members.pop(i) for i in indices]
        began = time.time()
        died = await asyncio.gather(*(m.die() for m in victims))
        at = {m.instance_id: t for m, t in zip(victims, died, strict=True)}
        return {"killed_at": at, "seconds": max(died, default=began) - began}

    async def leave(self) -> dict[str, Any]:
        leaving, self.members = list(self.members.values()), {}
        await asyncio.gather(*(m.leave() for m in leaving))
        return {"left": len(leaving)}


async def generator_main(args: argparse.Namespace) -> None:
    """A child: one JSON command a line on stdin, one JSON reply a line on stdout."""
    gen = Generator(args)
    await gen.open()
    ticker = asyncio.create_task(gen.tick())
    keeper = asyncio.create_task(gen.leases.keep())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    say({"event": "ready", "pid": os.getpid()})
    commands: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
        "grow": gen.grow,
        "kill": gen.kill,
        "leave": gen.leave,
        "status": gen.status,
    }
    while raw := await reader.readline():
        message = json.loads(raw)
        cmd, request_id = message.pop("cmd"), message.pop("id")
        if cmd == "exit":
            break
        try:
            say({"id": request_id, **await commands[cmd](**message)})
        except Exception as exc:  # the driver raises it with the command that failed
            say({"id": request_id, "error": f"{cmd}: {exc!r}"})
    ticker.cancel()
    await gen.leave()
    await cancel_and_wait(keeper)
    await gen.client.close()
