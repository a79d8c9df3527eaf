"""The local stack's dealings with an etcd in trouble: a real etcd whose quota is full."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import aetcd
import pytest

from robustrl.cli import job_commands, stack
from robustrl.cli.job_commands import keep_warning_about_etcd, warn_about_etcd
from robustrl.cli.stack import (
    StackState,
    alarm_warning,
    etcd_alarms,
    etcd_answers,
    etcd_healthy,
    free_ports,
    provisioned_procs,
)
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.provisioning import ProvisionedRecord
from robustrl.core.config import EtcdSettings
from tests.support import eventually
from tests.support.cluster import fill_etcd

PREFIX = "/robustrl-test"


def _record(logs: Path) -> ProvisionedRecord:
    """A provisioned rollout's record, its pid this process's."""
    return ProvisionedRecord(
        instance_id="rollout-p1",
        role="rollout",
        pid=os.getpid(),
        host=socket.gethostname(),
        argv=["python", "-m", "services.rollout"],
        log=str(logs / "rollout-p1.log"),
        job_id="job-1",
        reason="replacement",
        at=0.0,
    )


async def _record_then_fill(endpoints: str, record: ProvisionedRecord) -> None:
    host, port = endpoints.split(":")
    client = aetcd.Client(host=host, port=int(port))
    try:
        key = KeySpace(PREFIX).provisioned(record.instance_id)
        await client.put(key, record.model_dump_json().encode())
        await fill_etcd(client, PREFIX, one_key=False)
    finally:
        await client.close()


def test_down_finds_provisioned_members_while_etcd_is_out_of_space(
    small_etcd: str, tmp_path: Path
) -> None:
    """A job whose etcd filled its quota stops (no write succeeds), and `robustrl down` must
    still stop what the coordinators' provisioner started: etcd then answers /health with
    503 and an alarm, and `down` took that for no etcd and left the members running."""
    asyncio.run(_record_then_fill(small_etcd, _record(tmp_path)))
    assert not etcd_healthy(small_etcd) and etcd_answers(small_etcd)  # NOSPACE, readable

    state = StackState(home=str(tmp_path), etcd_endpoints=small_etcd, prefix=PREFIX)
    found = provisioned_procs(state)

    assert [(p.name, p.pid) for p in found] == [("rollout-p1", os.getpid())]


def test_an_etcd_that_is_not_there_does_not_answer() -> None:
    (port,) = free_ports(1)
    assert not etcd_answers(f"127.0.0.1:{port}")


def test_status_and_watch_say_why_a_full_etcd_stops_every_job(
    small_etcd: str,
    etcd_settings: EtcdSettings,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under NOSPACE no job makes progress and nothing says so: a watched job just stops
    moving. `robustrl status` and `watch` name the alarm and what to do; a healthy etcd
    gets no warning."""
    assert etcd_alarms(etcd_settings.endpoints) == []
    assert alarm_warning(etcd_settings.endpoints) is None
    asyncio.run(_record_then_fill(small_etcd, _record(tmp_path)))
    assert etcd_alarms(small_etcd) == ["NOSPACE"]
    assert etcd_alarms(f"127.0.0.1:{free_ports(1)[0]},{small_etcd}") == ["NOSPACE"]

    warn_about_etcd(small_etcd)
    said = capsys.readouterr().err
    assert "out of space" in said and "alarm disarm" in said

    # `watch` checks again and again (here every 0.05 s), and says it once.
    checks: list[str | None] = []

    def checked(endpoints: str) -> str | None:
        checks.append(alarm_warning(endpoints))
        return checks[-1]

    monkeypatch.setattr(job_commands, "ETCD_CHECK_INTERVAL", 0.05)
    monkeypatch.setattr(stack, "alarm_warning", checked)

    async def watch_a_while() -> None:
        task = asyncio.create_task(keep_warning_about_etcd(small_etcd))

        async def checked_often() -> bool:
            return len(checks) >= 5

        try:
            await eventually(checked_often, timeout=30)
        finally:
            task.cancel()

    asyncio.run(watch_a_while())
    assert all(check and "out of space" in check for check in checks)
    assert capsys.readouterr().err.count("out of space") == 1
