"""Coordinator replicas and a monitor as real gRPC servers in this process, on free ports; an
etcd with a small quota."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from tests.support.cluster import small_etcds, start_coordinators


@pytest.fixture
async def monitor(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    runtime = await serve_monitor(
        MonitorSettings(instance_id="monitor-0", reconnect_grace=0.5), etcd_settings
    )
    yield runtime
    await runtime.shutdown()


@pytest.fixture
async def coordinators(
    etcd_settings: EtcdSettings, monitor: ServiceRuntime
) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas with the local provisioner; the list is ordered leader first."""
    runtimes = await start_coordinators(etcd_settings)
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown()


@pytest.fixture
async def external_coordinators(
    etcd_settings: EtcdSettings,
) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas that take an external provisioner; leader first."""
    runtimes = await start_coordinators(etcd_settings, provisioner="external")
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown()


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[str]:
    """An etcd with a 1 MiB quota; its client endpoint."""
    with small_etcds(tmp_path, 1) as (member,):
        yield member.endpoint
