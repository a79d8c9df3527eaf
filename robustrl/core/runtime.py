"""The lifecycle every service shares: connect to etcd, open a session, start the gRPC
server, register in the registry, stream heartbeats, and shut all of it down in order.

If etcd becomes unreachable long enough for the session's lease to lapse, the runtime keeps
serving with what it knows and, once etcd answers again, opens a new session and registers
anew (same instance id and epoch). Owners that hold session-bound state (the coordinator's
election) wait on `next_session` to rebuild it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator

import aetcd

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.contracts.roles import ROLE_TO_PROTO
from robustrl.core.aio import retry_while
from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.etcd_client import connect_etcd, etcd_out_of_space
from robustrl.core.heartbeat import HeartbeatSender, Progress
from robustrl.core.logs import configure_logging, get_logger
from robustrl.core.registry import LeaseGone, Registry
from robustrl.core.server import GrpcHost
from robustrl.core.session import Session

log = get_logger(__name__)

CRASH_EXIT = 70
"""Exit status of `ServiceRuntime.crash` (EX_SOFTWARE: an internal error)."""


_freezing = False
"""Whether this process's main froze its start-up (`long_lived_objects(start=True)`)."""


@contextlib.contextmanager
def long_lived_objects(*, start: bool = False) -> Iterator[None]:
    """Make, inside the block, objects that live as long as the process, with the garbage
    collector off; then collect once and take everything left out of the collector's reach
    (gc.freeze). A service's main starts it around its imports (start=True); the trainer and
    rollout use it again around loading the model stack, which brings a further ~150,000
    objects of transformers. Elsewhere (a test process that runs a worker in-process) those
    later blocks run as they are.

    Unfrozen, every full collection walks all of those objects while the event loop (and so
    the member's RPCs and heartbeats) waits: decision 0002 has the pauses measured."""
    global _freezing
    _freezing = _freezing or start
    if not _freezing:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()  # start-up's garbage is freed, not kept for ever
        gc.freeze()
        gc.enable()


class ServiceRuntime:
    def __init__(
        self,
        role: str,
        settings: ServiceSettings,
        etcd_settings: EtcdSettings,
        *,
        service_names: list[str],
        heartbeats: bool = True,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        self.settings = settings
        self.etcd_settings = etcd_settings
        self.instance_id = settings.resolved_instance_id(role)
        self.keys = KeySpace(etcd_settings.prefix)
        self.host = GrpcHost(
            bind_host=settings.bind_host, port=settings.port, service_names=service_names
        )
        self.progress = Progress(epoch=settings.epoch)
        self.labels = labels or {}
        self._heartbeats = heartbeats
        self.client: aetcd.Client | None = None
        self.registry: Registry | None = None
        self.session: Session | None = None
        self.member: MemberRecord | None = None
        self.heartbeat: HeartbeatSender | None = None
        self._session_changed = asyncio.Condition()
        self._writes = asyncio.Lock()  # registry writes of this member, one at a time
        self._keeper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._stop_asked = asyncio.Event()  # set by SIGTERM/SIGINT or `ask_to_stop`
        self._free_space: Callable[[], Awaitable[object]] | None = None
        configure_logging(
            service=role,
            instance=self.instance_id,
            fmt=settings.log_format,
            level=settings.log_level,
        )
        # A native fault (in UCX, torch, grpc) ends the process before any Python handler
        # runs. With this it first writes every thread's Python stack to stderr, the log.
        faulthandler.enable(all_threads=True)

    def crash(self, reason: str) -> None:
        """End this process as a crash does: no goodbye beat, no deregistration, exit status
        CRASH_EXIT. For a failure the process cannot recover from itself (a bug in a worker
        loop): the monitor then reports it lost (its address refuses connections) and
        recovery replaces it, as for a kill -9, instead of it living on without working."""
        log.critical(f"{self.role}.crashed", reason=reason, exit_status=CRASH_EXIT)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(CRASH_EXIT)

    @property
    def address(self) -> str:
        return f"{self.settings.resolved_advertise_host()}:{self.host.port}"

    async def start(
        self,
        on_fenced: Callable[[], None] | None = None,
        free_space: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Connect to etcd, serve, register; the servicers must already be added to host.server.

        While etcd is out of space (NOSPACE: it grants no lease) registration waits instead of
        failing: a replacement member, or any service restarted meanwhile, starts once the
        coordinator leader has freed etcd. `free_space` (a coordinator's SpaceKeeper.keep) is
        called on each try, and on each failed try to register again after a lost session:
        a coordinator that starts then may be the only one, and no replica can win an
        election without a lease."""
        self.client = await connect_etcd(self.etcd_settings)
        self.registry = Registry(self.client, self.keys)
        await self.host.start()
        self.member = MemberRecord(
            role=self.role,
            instance_id=self.instance_id,
            address=self.address,
            pid=os.getpid(),
            host=socket.gethostname(),
            epoch=self.settings.epoch,
            labels=self.labels,
        )
        self._free_space = free_space
        await retry_while(
            self._open_session,
            etcd_out_of_space,
            waiting=f"{self.role}.start_waits_for_etcd_space",
            answered=f"{self.role}.registered_after_etcd_space",
            between=self._free_space_quietly,
            frees_it=free_space is not None,
        )
        self._keeper = asyncio.create_task(self._keep_registered(), name="keep-registered")
        if self._heartbeats:
            self.heartbeat = HeartbeatSender(
                self.registry,
                role=ROLE_TO_PROTO[self.role],
                instance_id=self.instance_id,
                progress=self.progress,
                interval=self.settings.heartbeat_interval,
                on_fenced=on_fenced,
            )
            self.heartbeat.start()
        # Shutdown order: goodbye and revoke first (peers learn at once), server and etcd after.
        self.host.before_stop.append(self._leave)
        self.host.after_stop.append(self._close_etcd)
        log.info(
            f"{self.role}.started",
            address=self.address,
            epoch=self.settings.epoch,
            gc_frozen=gc.get_freeze_count(),
        )

    async def _free_space_quietly(self) -> None:
        if self._free_space is None:
            return
        try:
            await self._free_space()
        except Exception as exc:
            log.warning("etcd.space_check_failed", error=repr(exc))

    async def _open_session(self) -> None:
        assert self.client is not None and self.registry is not None and self.member is not None
        session = await Session.open(self.client, self.etcd_settings.session_ttl)
        async with self._writes:  # the record as it is now, with every change made so far
            self.member = await self.registry.register(session, self.member)
        async with self._session_changed:
            self.session = session
            self._session_changed.notify_all()

    async def next_session(self, after: Session | None) -> Session:
        """The current session if it is not `after`, else wait for a new one."""
        async with self._session_changed:
            await self._session_changed.wait_for(
                lambda: self.session is not None and self.session is not after
            )
            assert self.session is not None
            return self.session

    async def _keep_registered(self) -> None:
        while not self._stopped.is_set():
            assert self.session is not None
            await self.session.done.wait()
            if self._stopped.is_set():
                return
            log.warning(f"{self.role}.session_lost")
            delay = 0.2
            while not self._stopped.is_set():
                try:
                    await self._open_session()
                    log.info(f"{self.role}.reregistered")
                    break
                except Exception as exc:  # etcd still away: keep serving, try again
                    log.info(f"{self.role}.reregister_failed", error=repr(exc))
                    if etcd_out_of_space(exc):
                        await self._free_space_quietly()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    async def update_member(
        self, *, labels: dict[str, str | None] | None = None, **changes: object
    ) -> None:
        """Rewrite this member's record: `changes` replace fields (job_id, epoch), `labels` are
        merged into its labels (None removes one). If the session's lease has expired (a
        process frozen past its TTL), the change is written under the next one: it must not be
        lost to a re-registration of the old record."""
        assert self.registry is not None and self.member is not None and self.session is not None
        session = self.session
        while True:
            # One write at a time, each made from the latest record: a write that finished late
            # must not hand back a record without a change made while it was in flight (the
            # change would be lost to the next re-registration, as a fenced rollout's leaving
            # its job once was).
            async with self._writes:
                before = self.member
                self.member = before.changed(labels, **changes)  # re-registrations too
                try:
                    self.member = await self.registry.register(session, self.member)
                    return
                except LeaseGone:
                    pass
                except BaseException:
                    # Not written (etcd refused it, or the caller gave up): the record in
                    # memory must not claim it was. Else a standby's "prepared" label refused
                    # by a full etcd would stay in memory only: every later PREPARE would find
                    # it labelled and write nothing, and the leader, which binds only a
                    # member whose stored record says prepared, would never bind it.
                    self.member = before
                    raise
            session = await self.next_session(after=session)

    async def _leave(self) -> None:
        self._stopped.set()
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self._keeper is not None:
            self._keeper.cancel()
        if self.session is not None:
            await self.session.close()

    async def _close_etcd(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()

    async def shutdown(self) -> None:
        await self.host.shutdown(self.settings.shutdown_grace)
        log.info(f"{self.role}.stopped")

    def ask_to_stop(self) -> None:
        """End `serve_until_signal` as SIGTERM would: the process shuts down in order and exits."""
        self._stop_asked.set()

    async def serve_until_signal(self) -> None:
        """Run until SIGTERM/SIGINT (or `ask_to_stop`), then shut down in order."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_asked.set)
        await self._stop_asked.wait()
        await self.shutdown()
