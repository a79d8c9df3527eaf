"""Connecting to etcd (aetcd) from a list of endpoints, with a deadline on every request, and
riding out the time etcd is unreachable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd

from robustrl.contracts.errors import Unavailable
from robustrl.core.aio import retry_while
from robustrl.core.config import EtcdSettings

T = TypeVar("T")

ETCD_UNREACHABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
"""What aetcd raises while no etcd answers (UNAVAILABLE, or the request's deadline passed).
Every other ClientError is an answer (a compacted revision, a bad argument) and not retried."""

NOSPACE_MESSAGE = "database space exceeded"


def etcd_out_of_space(exc: BaseException) -> bool:
    """Whether etcd refused a request because it raised NOSPACE (its quota is full, and it takes
    no write until the alarm is disarmed). The coordinator leader frees it by itself
    (coordinator/space.py), so callers wait it out as they wait out an unreachable etcd."""
    return isinstance(exc, aetcd.exceptions.ClientError) and NOSPACE_MESSAGE in str(exc)


def etcd_unavailable(exc: BaseException) -> bool:
    """Whether etcd cannot serve a request now but will later: unreachable, or out of space."""
    return isinstance(exc, ETCD_UNREACHABLE) or etcd_out_of_space(exc)


# gRPC refuses a received message over 4 MiB by default. etcd answers a watch that catches up
# with up to 1000 revisions in one message, and the ledger is rewritten on every lease with a
# few KB, so a watch resuming after a pause of half a minute met a larger answer and broke at
# the same revision on every try. watch_prefix resyncs if even this is not enough.
MAX_RECEIVE_BYTES = 256 << 20


async def connect_etcd(settings: EtcdSettings) -> aetcd.Client:
    """Return a client connected to the first endpoint that answers a status request."""
    failures: list[str] = []
    for host, port in settings.endpoint_list():
        client = aetcd.Client(
            host=host,
            port=port,
            timeout=int(max(1, settings.timeout)),
            options={"grpc.max_receive_message_length": MAX_RECEIVE_BYTES},
        )
        try:
            await client.connect()
            await client.status()
        except Exception as exc:  # any failure means: try the next endpoint
            failures.append(f"{host}:{port}: {type(exc).__name__}")
            await client.close()
            continue
        return client
    raise Unavailable(f"no etcd endpoint answered ({'; '.join(failures)})")


async def until_etcd_answers(
    call: Callable[[], Awaitable[T]], doing: str, on_wait: Callable[[], None] | None = None
) -> T:
    """`call()`, made again for as long as it fails because etcd is unreachable or out of space
    (`etcd_unavailable`, `retry_while`); any other error is raised. For work that cannot go on
    without etcd and must not be given up either (the failure table: etcd unreachable pauses
    nobody for good). Logs `etcd.unreachable` (with the error) once and `etcd.reachable` with
    how long `doing` waited."""
    return await retry_while(
        call,
        etcd_unavailable,
        waiting="etcd.unreachable",
        answered="etcd.reachable",
        on_wait=on_wait,
        doing=doing,
    )
