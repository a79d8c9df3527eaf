"""Connecting to etcd (aetcd) from a list of endpoints, with a deadline on every request."""

from __future__ import annotations

import aetcd

from services.common.config import EtcdSettings
from services.common.errors import Unavailable


async def connect_etcd(settings: EtcdSettings) -> aetcd.Client:
    """Return a client connected to the first endpoint that answers a status request."""
    failures: list[str] = []
    for host, port in settings.endpoint_list():
        client = aetcd.Client(host=host, port=port, timeout=int(max(1, settings.timeout)))
        try:
            await client.connect()
            await client.status()
        except Exception as exc:  # any failure means: try the next endpoint
            failures.append(f"{host}:{port}: {type(exc).__name__}")
            await client.close()
            continue
        return client
    raise Unavailable(f"no etcd endpoint answered ({'; '.join(failures)})")
