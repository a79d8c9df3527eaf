"""The `robustrl` command as a user runs it, against a local stack in a home of the test's own.
Reads (`json` of status, members, jobs, incidents, dropped) are served in-process by a
StackReader with the CLI's own read functions; every other command is a real CLI process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from robustrl.cli.stack import StackState, find_etcd
from robustrl.contracts import packed
from tests.support import stack_template
from tests.support.paths import REPO
from tests.support.reader import StackReader


class Cli:
    def __init__(self, home: Path, *, own_template: bool = False) -> None:
        """`own_template`: `up` starts the stack's own warm template, instead of forking from
        the one this test process shares between its stacks (`tests/support/stack_template`)."""
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROBUSTRL_")}
        self.env["ROBUSTRL_HOME"] = str(home)
        self.own_template = own_template
        self._reader: StackReader | None = None

    def run(
        self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        if args and args[0] in ("up", "down"):
            self.close_reader()  # the stack's etcd changes
        if args and args[0] == "up" and not self.own_template:
            self.env["ROBUSTRL_TEMPLATE_SOCKET"] = stack_template.socket()
        result = subprocess.run(
            self.argv(*args),
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"robustrl {' '.join(args)} failed: {result.stderr}")
        return result

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "robustrl.cli.main", *args]

    def json(self, *args: str) -> Any:
        """What `robustrl ARGS --json` prints, parsed: read in-process where the reader serves
        the command, else from a CLI process."""
        if StackReader.serves(*args):
            return self.reader().read(*args)
        return json.loads(self.run(*args, "--json").stdout)

    def reader(self) -> StackReader:
        if self._reader is None:
            if self.env.get("ROBUSTRL_ETCD_ENDPOINTS"):
                endpoints = self.env["ROBUSTRL_ETCD_ENDPOINTS"]
                prefix = self.env.get("ROBUSTRL_ETCD_PREFIX", "/robustrl")
            else:
                state = StackState.load(self.home)
                assert state is not None, f"no local stack in {self.home}: `up` first"
                endpoints, prefix = state.etcd_endpoints, state.prefix
            self._reader = StackReader(endpoints, prefix)
        return self._reader

    def close_reader(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            reader.close()

    def members(self) -> list[dict[str, object]]:
        members = self.json("members")
        assert isinstance(members, list)
        return members

    def jobs(self) -> list[dict[str, Any]]:
        jobs = self.json("jobs")
        assert isinstance(jobs, list)
        return jobs

    def status(self, job_id: str) -> dict[str, Any]:
        status = self.json("status", job_id)
        assert isinstance(status, dict)
        return status


def chaos(cli: Cli, job: str, *args: str, timeout: float = 60) -> list[dict[str, Any]]:
    out = json.loads(cli.run("chaos", job, *args, "--json", timeout=timeout).stdout)
    assert isinstance(out, list)
    return out


def etcd_json(cli: Cli, key: str) -> dict[str, object]:
    state = StackState.load(cli.home)
    assert state is not None
    etcdctl = Path(find_etcd()).with_name("etcdctl")
    out = subprocess.run(
        [str(etcdctl), f"--endpoints={state.etcd_endpoints}", "get", key, "--print-value-only"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    # The ledger and the ETTR account are stored compressed (robustrl.contracts.packed).
    value: dict[str, object] = json.loads(packed.json_of(out))
    return value
