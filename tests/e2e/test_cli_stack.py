"""The local stack as a user drives it: `robustrl` commands against real service processes."""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from robustrl.cli.stack import StackState, find_etcd, is_running
from tests.support import eventually_sync, process_state
from tests.support.cli import Cli
from tests.support.paths import EXAMPLE, REPO
from tests.support.processes import parent_of
from tests.support.recovery import end_after_recoveries
from tests.support.stack_template import template_pid

TTL = 5.0  # the default session TTL the stack runs with


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    yield from up_and_down(Cli(tmp_path / "home"))


@pytest.fixture
def cli_own_template(tmp_path: Path) -> Iterator[Cli]:
    """A stack whose `up` starts its warm template, as it does outside the tests."""
    yield from up_and_down(Cli(tmp_path / "home", own_template=True))


def up_and_down(cli: Cli) -> Iterator[Cli]:
    up = cli.run("up", "--trainers", "1", "--rollouts", "1")
    assert "stack up" in up.stdout
    try:
        yield cli
    finally:
        cli.run("down", check=False)
        state = StackState.load(cli.home)
        assert state is not None and state.procs == []


@pytest.mark.slow
def test_a_new_user_session(cli: Cli) -> None:
    members = cli.members()
    assert sorted(str(m["instance_id"]) for m in members) == [
        "coordinator-0",
        "coordinator-1",
        "monitor-0",
        "rollout-0",
        "trainer-0",
    ]
    assert sum(1 for m in members if m["leader"]) == 1
    # Each service froze what its imports made before it served (runtime.long_lived_objects).
    for member in members:
        log = (cli.home / "logs" / f"{member['instance_id']}.log").read_text()
        started = next(line for line in log.splitlines() if f"{member['role']}.started" in line)
        frozen = re.search(r"gc_frozen=(\d+)", started)
        assert frozen is not None and int(frozen.group(1)) > 10_000, started
    # The monitor started itself again on jemalloc (`make` installs libjemalloc2): memory it
    # frees once members leave goes back to the system.
    [monitor] = [m for m in members if m["role"] == "monitor"]
    assert "libjemalloc" in Path(f"/proc/{monitor['pid']}/maps").read_text()

    submitted = cli.json("submit", str(EXAMPLE), "trainer.steps=5", "--id", "first")
    assert isinstance(submitted, dict) and submitted["job_id"] == "first"
    status = cli.json("status", "first")
    assert isinstance(status, dict)
    assert status["phase"] == "PENDING" and status["spec"]["trainer"]["steps"] == 5
    overview = cli.json("status")
    assert isinstance(overview, dict) and [j["job_id"] for j in overview["jobs"]] == ["first"]

    bad = cli.run("submit", str(EXAMPLE), "trainer.lr=-1", check=False)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "trainer.lr" in bad.stderr
    missing = cli.run("status", "nope", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    missing = cli.run("dropped", "nope", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    assert cli.json("dropped", "first") == {}  # a job not started yet dropped nothing
    missing = cli.run("weights", "nope", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    assert "no weights published yet" in cli.run("weights", "first").stdout
    no_file = cli.run("submit", "no-such.yaml", check=False)
    assert no_file.returncode == 2 and "cannot read job spec" in no_file.stderr
    bad_history = cli.run("up", "--etcd-history", "5 minutes", check=False)
    assert bad_history.returncode == 2 and "must be like 30s, 5m or 1h" in bad_history.stderr

    cli.run("cancel", "first")
    again = cli.run("cancel", "first", check=False)
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr
    cli.run("submit", str(EXAMPLE), "--id", "second")
    running = cli.run("delete", "second", check=False)
    assert running.returncode == 1 and "FAILED_PRECONDITION" in running.stderr
    assert "job first deleted" in cli.run("delete", "first").stdout
    missing = cli.run("delete", "first", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    listed = cli.json("jobs")
    assert isinstance(listed, list) and [j["job_id"] for j in listed] == ["second"]
    cli.run("cancel", "second")
    cli.run("delete", "second")
    piped = cli.run("submit", "-", "--id", "piped", "trainer.steps=7", stdin=EXAMPLE.read_text())
    assert "submitted job piped" in piped.stdout
    status = cli.json("status", "piped")
    assert isinstance(status, dict) and status["spec"]["trainer"]["steps"] == 7
    cli.run("cancel", "piped")
    cli.run("delete", "piped")

    # etcdctl shows the members under the key layout the README documents.
    state = StackState.load(cli.home)
    assert state is not None
    etcdctl = Path(find_etcd()).with_name("etcdctl")
    keys = subprocess.run(
        [
            str(etcdctl),
            f"--endpoints={state.etcd_endpoints}",
            "get",
            "--prefix",
            "/robustrl/",
            "--keys-only",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert "/robustrl/members/rollout/rollout-0" in keys
    assert not [k for k in keys if "/first" in k or "/second" in k], "a deleted job left keys"


@pytest.mark.slow
def test_kill_9_of_the_leader_hands_over_within_the_ttl_and_keeps_every_job(cli: Cli) -> None:
    for i in range(3):
        cli.run("submit", str(EXAMPLE), "--id", f"job-{i}")
    cli.run("cancel", "job-2")
    before = cli.json("jobs")
    leader = next(m for m in cli.members() if m["leader"])
    # The follower has checked the live leader's address all along: never taken for gone.
    for log_file in (cli.home / "logs").glob("coordinator-*.log"):
        assert "election.leader_unseated" not in log_file.read_text()

    os.kill(int(str(leader["pid"])), signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()

    def new_leader() -> bool:
        return any(m["leader"] and m["pid"] != leader["pid"] for m in cli.members())

    eventually_sync(new_leader, timeout=TTL + 5, interval=0.05)
    took = time.monotonic() - killed_at
    # Lease expiry (at most the TTL after the last refresh) plus one CLI round trip.
    assert took <= TTL + 1.5, f"new leader after {took:.1f}s"
    # Sooner in fact: the replica next in line found the dead leader's address refusing
    # connections and revoked its lease, instead of waiting for the lease to run out.
    successor = next(m for m in cli.members() if m["leader"])
    log_file = cli.home / "logs" / f"{successor['instance_id']}.log"
    # Its election is in etcd before its log line is written: wait for the line, whose
    # stamp is the time of the election.
    eventually_sync(lambda: "coordinator.elected" in log_file.read_text(), timeout=5)
    log = log_file.read_text()
    assert "election.leader_unseated" in log
    elected = [line for line in log.splitlines() if "coordinator.elected" in line][-1]
    stamp = datetime.datetime.fromisoformat(elected.split()[0].replace("Z", "+00:00"))
    led_after = stamp.timestamp() - killed_wall
    assert led_after < TTL / 2, f"led {led_after:.2f}s after the kill"

    after = cli.json("jobs")
    assert after == before
    # The new leader takes writes.
    cli.run("submit", str(EXAMPLE), "--id", "after-failover")


@pytest.mark.slow
def test_a_member_killed_with_9_leaves_and_the_monitor_reports_it(cli: Cli) -> None:
    rollout = next(m for m in cli.members() if m["role"] == "rollout")
    os.kill(int(str(rollout["pid"])), signal.SIGKILL)
    killed_at = time.monotonic()

    def reported() -> bool:
        incidents = cli.json("incidents")
        assert isinstance(incidents, list)
        return any(
            i["instance_id"] == "rollout-0" and i["kind"] == "MEMBER_LOST" for i in incidents
        )

    eventually_sync(reported, timeout=TTL + 2)
    reported_after = time.monotonic() - killed_at

    def gone() -> bool:
        return all(m["instance_id"] != "rollout-0" for m in cli.members())

    eventually_sync(gone, timeout=TTL + 2)
    gone_after = time.monotonic() - killed_at
    assert gone_after <= TTL + 1.5, f"still a member {gone_after:.1f}s after kill -9"
    assert reported_after <= TTL + 1.5
    incidents = cli.json("incidents")
    assert isinstance(incidents, list) and len(incidents) == 1  # one loss, one incident


@pytest.mark.slow
def test_down_stops_exactly_what_up_started(cli_own_template: Cli) -> None:
    cli = cli_own_template
    state = StackState.load(cli.home)
    assert state is not None and len(state.procs) == 7  # etcd, the warm template, 5 services
    # The trainer and the rollout were forked from the stack's template (their imports done).
    template = next(p for p in state.procs if p.role == "template")
    forked = [p for p in state.procs if p.role in ("trainer", "rollout")]
    assert len(forked) == 2 and all(parent_of(p.pid) == template.pid for p in forked)
    socket_dir = Path(state.template_socket).parent
    assert socket_dir.is_dir()
    cli.run("down")
    assert not any(is_running(p) for p in state.procs)
    assert not socket_dir.exists()
    assert "no local stack running" in cli.run("jobs", check=False).stderr


@pytest.mark.slow
def test_down_then_up_keeps_every_job_and_a_running_one_goes_on(cli: Cli, model_dir: Path) -> None:
    """`down` without --purge keeps etcd's data; the next `up` starts etcd on it again, on the
    same ports, though a stopped stack leaves connections to them in TIME_WAIT for a minute,
    and on new ones (the data kept) when another process took them. A job that ran when the
    stack stopped goes on: `down` stops the coordinators first and the monitor last, which
    records each member's clean stop as the job's loss; the next leader recovers it from
    there."""
    cli.run(
        "submit",
        str(EXAMPLE),
        "--id",
        "running",
        f"model.path={model_dir}",
        "rollout.replicas=1",
        "trainer.groups_per_step=8",
        "trainer.steps=150",
        "trainer.eval_every=1000",
    )
    eventually_sync(lambda: cli.status("running")["step"] >= 5, timeout=120, interval=0.5)
    cli.run("submit", str(EXAMPLE), "--id", "kept", "rollout.replicas=3")  # waits for rollouts
    before = StackState.load(cli.home)
    assert before is not None
    # A stack given a template (`--template-socket`) forks from it and does not stop it.
    shared = template_pid(before)
    assert before.template_shared and "template" not in {p.role for p in before.procs}
    forked = [p.pid for p in before.procs if p.role in ("trainer", "rollout")]
    assert forked and all(parent_of(pid) == shared for pid in forked)
    cli.run("down")
    assert Path(before.template_socket).exists() and process_state(shared) != "Z"
    cli.run("up", "--trainers", "1", "--rollouts", "1")
    after = StackState.load(cli.home)
    assert after is not None
    assert (after.etcd_client_port, after.etcd_peer_port) == (
        before.etcd_client_port,
        before.etcd_peer_port,
    )
    assert sorted(j["job_id"] for j in cli.jobs()) == ["kept", "running"]
    # Its 150 steps are for a job still running when `down` comes on a loaded machine: once it
    # has recovered its members, it ends a few steps on.
    steps = end_after_recoveries(cli, "running")
    eventually_sync(lambda: cli.status("running")["phase"] == "SUCCEEDED", timeout=150, interval=1)
    assert cli.status("running")["step"] == steps
    incidents = cli.json("incidents", "running")
    assert isinstance(incidents, list)
    assert sorted(i["instance_id"] for i in incidents) == ["rollout-0", "trainer-0"]
    assert all("stopped cleanly (a goodbye)" in i["evidence"] for i in incidents)
    # A reader that stops reading (`| head`) ends the command quietly, as SIGPIPE would.
    reader_gone = subprocess.Popen(
        cli.argv("status", "running", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli.env,
        cwd=REPO,
    )
    assert reader_gone.stdout is not None
    reader_gone.stdout.close()  # long before the command writes: it takes ~1 s to start
    _, stderr = reader_gone.communicate(timeout=60)
    assert reader_gone.returncode == 128 + signal.SIGPIPE and b"Traceback" not in stderr

    # Someone else listens on etcd's client port now: new ports, the same data.
    cli.run("down")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", after.etcd_client_port))
        squatter.listen()
        cli.run("up")
    moved = StackState.load(cli.home)
    assert moved is not None and moved.etcd_client_port != after.etcd_client_port
    assert sorted(j["job_id"] for j in cli.jobs()) == ["kept", "running"]
