"""One bootstrap for every service's gRPC server.

`GrpcHost` creates the aio server with our interceptors, the standard health service and
reflection, binds (port 0 allowed: the real port is returned), and shuts down in order:
health NOT_SERVING first so load balancers stop sending, then the owner's `before_stop`
hooks (resign the election, say goodbye, revoke the lease), then `server.stop(grace)`, then
the owner's `after_stop` hooks (close transports). `shutdown()` is idempotent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from robustrl.core.interceptors import ErrorMappingInterceptor
from robustrl.core.logs import get_logger

log = get_logger(__name__)

Hook = Callable[[], Awaitable[None]]

HOOK_TIMEOUT = 5.0
"""Seconds one shutdown hook may take; shutdown goes on without it after that."""


class GrpcHost:
    def __init__(self, *, bind_host: str, port: int, service_names: list[str]) -> None:
        self.server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor()],
            options=[
                # Our clients ping every 10 s (channels.open_channel) to notice a dead peer on a
                # quiet stream. The default server policy allows one ping per 5 min without
                # data and answers more with GOAWAY "too_many_pings", which broke rollouts'
                # idle streams to the trainer while it was away.
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self._bind = f"{bind_host}:{port}"
        self.port = 0
        self.before_stop: list[Hook] = []
        self.after_stop: list[Hook] = []
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.port = self.server.add_insecure_port(self._bind)
        if self.port == 0:
            raise RuntimeError(f"could not bind gRPC server to {self._bind}")
        await self.server.start()
        await self.set_serving(True)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def shutdown(self, grace: float) -> None:
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._shutdown(grace))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, grace: float) -> None:
        await self.set_serving(False)
        await _run_hooks(self.before_stop)
        await self.server.stop(grace)
        await _run_hooks(self.after_stop)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def _run_hooks(hooks: list[Hook]) -> None:
    for hook in hooks:
        try:
            await asyncio.wait_for(hook(), HOOK_TIMEOUT)
        except Exception as exc:  # keep going: the rest of shutdown must still happen
            log.warning("service.shutdown_hook_failed", hook=hook.__qualname__, error=repr(exc))
