"""The local provisioner's warm template against real processes and a real etcd: members are
forked from it (the first waits while it imports), register like any member under the
instance id and labels their environment names, run in sessions of their own and outlive the
template; with the template off, a member starts as a fresh interpreter."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from robustrl.cli.stack import Proc, is_running
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.provisioning import ProvisionedRecord
from robustrl.core.config import EtcdSettings
from robustrl.core.processes import running
from robustrl.core.registry import Registry
from robustrl.core.template import TemplateRefused, request_fork
from services.coordinator.provisioner import LocalProvisioner
from tests.support import eventually
from tests.support.forked import template
from tests.support.processes import parent_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_members_are_forked_from_the_template_register_and_outlive_it(
    etcd_settings: EtcdSettings, etcd_client: Any, tmp_path: Path
) -> None:
    keys = KeySpace(etcd_settings.prefix)
    registry = Registry(etcd_client, keys)
    logs = tmp_path / "logs"
    local = LocalProvisioner(etcd_client, keys, etcd_settings, str(logs))
    fresh = LocalProvisioner(etcd_client, keys, etcd_settings, str(logs), template=False)
    pids: list[int] = []
    try:
        names = [await local.request("rollout", "j", "first")]
        # The caller did not wait for the template's imports (a recovery asks under the job's
        # lock); the member waits for the template in the background.
        assert local.template is not None and not local.template.ready
        names.append(await local.request("trainer", "j", "second", standby=True))
        names.append(await fresh.request("rollout", "j", "third"))
        assert fresh.template is None
        template_pid = local.template.pid

        async def recorded() -> bool:
            return all([await etcd_client.get(keys.provisioned(n)) for n in names])

        await eventually(recorded, timeout=60)
        records = []
        for name in names:
            stored = await etcd_client.get(keys.provisioned(name))
            records.append(ProvisionedRecord.model_validate_json(stored.value))
        pids = [record.pid for record in records]
        assert [parent_of(pid) for pid in pids] == [template_pid, template_pid, os.getpid()]
        # `robustrl down` finds each by the command line recorded (pid reuse guard).
        for record in records:
            assert is_running(Proc(record.instance_id, record.pid, record.argv, record.log))
        assert all(os.getsid(pid) == pid for pid in pids)  # each in a session of its own

        async def registered() -> bool:
            found = [await registry.get(r.role, r.instance_id) for r in records]
            return all(
                m is not None and m.pid == r.pid for m, r in zip(found, records, strict=True)
            )

        await eventually(registered, timeout=90)
        # It took the environment asked for: registered under the instance id and the standby
        # flag it names (/proc/<pid>/environ shows the template's: it is fixed at exec).
        trainer = await registry.get("trainer", names[1])
        assert trainer is not None and trainer.labels.get("standby") == "true"

        async def logged() -> bool:  # its own log, as it runs (unbuffered, as asked)
            return all("started" in (logs / f"{name}.log").read_text() for name in names)

        await eventually(logged, timeout=30)

        socket_dir = local.template.socket_path.parent
        await local.close()
        assert template_pid is not None and not running(template_pid)
        assert not socket_dir.exists()
        assert all(running(pid) for pid in pids)  # the members outlive the template
    finally:
        await local.close()
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


async def test_the_template_runs_only_what_it_preloaded_with_the_args_and_pipes_asked_for(
    tmp_path: Path,
) -> None:
    """`json.tool` stands in for a member: it reads stdin, writes stdout, takes arguments."""
    with template("json.tool") as warm:
        proc = await warm.spawn("json.tool", ["--compact"], dict(os.environ), tmp_path / "err")
        assert parent_of(proc.pid) == warm.proc.pid
        proc.stdin.write(b'{"a": [1, 2]}\n')
        proc.stdin.close()
        assert await asyncio.wait_for(proc.stdout.read(), 30) == b'{"a":[1,2]}\n'
        await asyncio.wait_for(proc.wait(), 30)
        assert proc.returncode is not None
        for module in ("os", "services.trainer", "json.decoder", "json.tool.x"):
            with pytest.raises(TemplateRefused, match="neither preloaded"):
                request_fork(warm.socket, module, {}, tmp_path / "never.log")
        assert not (tmp_path / "never.log").exists()
        with pytest.raises(TemplateRefused, match="neither a log nor"):
            request_fork(warm.socket, "json.tool", {})
        # A request with a log and no pipes: stdin is /dev/null, output goes to the log.
        (tmp_path / "in.json").write_text('{"b": 1}')
        out = tmp_path / "out.log"
        request_fork(
            warm.socket, "json.tool", {}, out, args=("--compact", str(tmp_path / "in.json"))
        )

        async def logged() -> bool:
            return out.exists() and out.read_text() == '{"b":1}\n'

        await eventually(logged, timeout=30)


async def test_a_fork_with_pipes_stands_when_the_template_answered_before_the_client_went_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request with its pipes goes in one message; the template may fork, answer and close
    the connection before the client's next call. Here the client always comes second."""
    sent_whole = socket.send_fds

    def then_wait_for_the_template(conn: socket.socket, *args: Any) -> int:
        sent = sent_whole(conn, *args)
        hung_up = select.poll()
        hung_up.register(conn, select.POLLRDHUP)
        assert hung_up.poll(30_000), "the template never answered"
        return sent

    monkeypatch.setattr(socket, "send_fds", then_wait_for_the_template)
    with template("json.tool") as warm:
        proc = await warm.spawn("json.tool", ["--compact"], dict(os.environ), tmp_path / "err")
        proc.stdin.write(b"[3]\n")
        proc.stdin.close()
        assert await asyncio.wait_for(proc.stdout.read(), 30) == b"[3]\n"
        await asyncio.wait_for(proc.wait(), 30)
