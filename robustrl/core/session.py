"""An etcd session: a lease kept alive in the background, like etcd's concurrency.Session.

Keys written under the session's lease vanish when the process dies (the lease expires after
its TTL) or when the session is closed (the lease is revoked at once). `done` is set when the
lease is lost, so owners can step down (an elected leader) or register again (a member).
"""

from __future__ import annotations

import asyncio
import time

import aetcd
import grpc

from robustrl.core.aio import cancel_and_wait
from robustrl.core.logs import get_logger

log = get_logger(__name__)


class Session:
    def __init__(self, client: aetcd.Client, lease_id: int, ttl: int) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.done = asyncio.Event()
        self._closed = False
        self.lost = False  # the lease expired or was revoked elsewhere: nothing to revoke
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, client: aetcd.Client, ttl: int) -> Session:
        lease = await client.lease(ttl)
        session = cls(client, lease.id, ttl)
        session._task = asyncio.create_task(session._keepalive(), name=f"lease-{lease.id:x}")
        return session

    async def _keepalive(self) -> None:
        # Refresh at a third of the TTL so two refreshes can fail before the lease expires.
        interval = max(self.ttl / 3.0, 0.1)
        last_ok = time.monotonic()
        while not self._closed:
            try:
                reply = await asyncio.wait_for(self.client.refresh_lease(self.lease_id), interval)
                if reply is None or reply.TTL <= 0:
                    log.warning("etcd.lease_lost", lease=f"{self.lease_id:x}", reason="expired")
                    self.lost = True
                    break
                last_ok = time.monotonic()
            except (TimeoutError, aetcd.exceptions.ClientError) as exc:
                if time.monotonic() - last_ok > self.ttl:
                    log.warning("etcd.lease_lost", lease=f"{self.lease_id:x}", reason=repr(exc))
                    self.lost = True
                    break
            await asyncio.sleep(interval)
        self.done.set()

    async def detach(self) -> None:
        """Stop refreshing the lease without revoking it: its keys stay until the TTL runs out
        (what they say must outlive this process for a while). Idempotent."""
        self._closed = True
        await cancel_and_wait(self._task)
        self.done.set()

    async def close(self) -> None:
        """Revoke the lease (its keys go at once). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._task)
        if not self.lost:
            try:
                await asyncio.wait_for(self.client.revoke_lease(self.lease_id), 2.0)
            except (TimeoutError, aetcd.exceptions.ClientError) as exc:
                # The lease still expires by its TTL; peers only learn a little later.
                log.warning("etcd.revoke_failed", lease=f"{self.lease_id:x}", error=repr(exc))
        self.done.set()


def lease_gone(exc: BaseException) -> bool:
    """Whether etcd refused a write because the lease it was made under no longer exists (it
    expired while etcd was unreachable; the session's keepalive may not have noticed yet)."""
    cause = exc.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.NOT_FOUND
