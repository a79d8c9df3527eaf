"""The `robustrl` command as a user runs it, against a local stack in a home of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from robustrl.cli.stack import StackState, find_etcd
from robustrl.contracts import packed
from tests.support.paths import REPO


class Cli:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROBUSTRL_")}
        self.env["ROBUSTRL_HOME"] = str(home)

    def run(
        self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
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

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--json").stdout)

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
