"""Client channels. Retries go through gRPC's service config, never through loops of ours;
callers pass a deadline on every call (`timeout=`)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc

_RETRY_SERVICES = [
    "robustrl.v1.Coordinator",
    "robustrl.v1.Monitor",
    "robustrl.v1.Trainer",
    "robustrl.v1.Rollout",
]

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": s} for s in _RETRY_SERVICES],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

DEFAULT_DEADLINE = 10.0
"""Seconds: the deadline for unary calls whose caller names none."""


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.service_config", SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            # Notice a dead peer on an idle stream within seconds, not at TCP timeout.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ],
    )


async def refuses_connections(address: str, timeout: float) -> bool | None:
    """Whether a process still listens at a member's address (host:port), from one TCP
    connect: True when the connection is refused (nothing listens there: the process is gone),
    False when it is accepted, None when neither is known (a timeout, an unreachable host, an
    address that is not host:port), which is also how a stopped or cut-off process looks."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout
        )
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False
