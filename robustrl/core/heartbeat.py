"""The heartbeat stream every role keeps open to the monitor.

It finds its monitor in the registry (no address is configured): with several monitors, the
one `assignment.owner` names for this member. It sends a beat with the caller's progress
counters every interval, and reconnects — to whichever monitor then owns it — when the stream
breaks or the monitor acks that the member moved to another. On a clean stop it sends a
goodbye and waits for its acknowledgement, so the monitor never mistakes a shutdown for a
crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from robustrl.contracts.roles import ROLE_FROM_PROTO
from robustrl.core.assignment import assignment_key, owner
from robustrl.core.channels import open_channel
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry
from robustrl.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc

log = get_logger(__name__)


@dataclass
class Progress:
    """What a role reports in its beats; the role mutates it, the sender reads it.

    Roles may mutate it from worker threads (a float store is atomic under the GIL); `urge`
    is the one call that must reach the event loop, and it is safe from any thread.
    """

    phase: str = "idle"
    phase_started_at: float = field(default_factory=time.time)
    job_id: str = ""
    epoch: int = 0
    """The epoch of the binding to `job_id` (the fence check compares it with the fence's)."""
    rank: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    _wake: Callable[[], None] | None = field(default=None, repr=False)

    def enter(self, phase: str) -> None:
        """Start a phase (its budget counts from now); re-entering the same phase restarts it."""
        self.phase = phase
        self.phase_started_at = time.time()

    def set_counter(self, name: str, value: float) -> None:
        """Set a counter, also from a worker thread: a new key replaces the dict instead of
        growing it, so the sender, copying it on the event loop, never sees it change size."""
        if name in self.counters:
            self.counters[name] = value
        else:
            self.counters = {**self.counters, name: value}

    def urge(self) -> None:
        """Send a beat now rather than at the next interval (a NaN must be seen in its step)."""
        if self._wake is not None:
            self._wake()


class HeartbeatSender:
    def __init__(
        self,
        registry: Registry,
        *,
        role: common_pb2.Role.ValueType,
        instance_id: str,
        progress: Progress,
        interval: float,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.role = role
        self.role_name = ROLE_FROM_PROTO.get(role, "")
        self.instance_id = instance_id
        self.progress = progress
        self.interval = interval
        self.on_fenced = on_fenced
        self.connected = asyncio.Event()
        self._seq = 0
        self._stop = asyncio.Event()
        self._urgent = asyncio.Event()
        self._moved = False
        self._task: asyncio.Task[None] | None = None
        self.monitor_id = ""
        """The monitor the stream is open to ("" while there is none)."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def wake() -> None:
            loop.call_soon_threadsafe(self._urgent.set)

        self.progress._wake = wake
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def _pause(self) -> None:
        """Until the next beat is due: the interval, an urgent beat, or stop (which also
        sets `_urgent`, so one event covers both)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._urgent.wait(), self.interval)
        self._urgent.clear()

    def _beat(self, goodbye: bool = False) -> monitor_pb2.Beat:
        self._seq += 1
        beat = monitor_pb2.Beat(
            role=self.role,
            instance_id=self.instance_id,
            epoch=self.progress.epoch,
            job_id=self.progress.job_id,
            rank=self.progress.rank,
            seq=self._seq,
            phase=self.progress.phase,
            goodbye=goodbye,
        )
        beat.phase_started_at.FromNanoseconds(int(self.progress.phase_started_at * 1e9))
        beat.counters.update(self.progress.counters)
        return beat

    async def _run(self) -> None:
        moved_from = ""
        while not self._stop.is_set():
            try:
                monitors, _ = await self.registry.list("monitor")
                by_id = {m.instance_id: m for m in monitors}
                key = assignment_key(self.role_name, self.instance_id, self.progress.job_id)
                chosen = owner(key, by_id)
                if chosen is not None and chosen == moved_from:
                    # The monitor that sent it away has not yet seen the registry it was
                    # judged by (a monitor just joined or left): ask it again a beat later.
                    await self._pause()
                moved_from = ""
                if chosen is not None:
                    self.monitor_id = chosen
                    await self._stream(by_id[chosen].address)
            except (grpc.aio.AioRpcError, OSError) as exc:
                log.info("heartbeat.reconnect", reason=type(exc).__name__)
            except Exception as exc:  # etcd hiccup: keep trying, beats are best effort
                log.info("heartbeat.reconnect", reason=repr(exc))
            self.connected.clear()
            if self._moved:
                self._moved = False
                moved_from = self.monitor_id
                log.info("heartbeat.moved", member=self.instance_id, monitor=moved_from)
                self.monitor_id = ""
                continue  # to the monitor that owns it now, at once
            self.monitor_id = ""
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)

    async def _stream(self, address: str) -> None:
        async with open_channel(address) as channel:
            call = monitor_pb2_grpc.MonitorStub(channel).Heartbeat()
            reader = asyncio.create_task(self._read_acks(call))
            try:
                while not self._stop.is_set():
                    await call.write(self._beat())
                    self.connected.set()
                    await self._pause()
                    if reader.done():
                        reader.result()
                        return
                await call.write(self._beat(goodbye=True))
                await call.done_writing()
                await asyncio.wait_for(asyncio.shield(reader), 2.0)
            finally:
                reader.cancel()

    async def _read_acks(self, call: grpc.aio.StreamStreamCall) -> None:
        async for ack in call:
            if ack.fenced and self.on_fenced is not None:
                self.on_fenced()
            if ack.moved and not self._stop.is_set():
                self._moved = True
                self._urgent.set()  # the writer ends this stream now
                return

    async def stop(self) -> None:
        """Say goodbye (if connected) and stop. Idempotent."""
        self._stop.set()
        self._urgent.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 3.0)
            self._task.cancel()
