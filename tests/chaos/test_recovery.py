"""Recover only the failed role, against real processes: each fault is injected into a
running job, the job still succeeds, no trajectory is trained twice, and every prompt group
is trained or accounted for. This file: lost and hung rollouts, a poison group, the ways a
replacement rollout is found, and an etcd outage; test_recovery_trainers.py has the trainer
and the control plane.

Each job is ended relative to the recovery it tests: submitted with a budget no recovery
outlasts, lowered (`robustrl update`) a few steps past the recovery's end. The tests that start
their stack as `up` starts it by default share one (`shared_stack`, last in the file), from the
tests that leave it as they found it to the ones that replace members."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from robustrl.cli.stack import StackState
from robustrl.core.config import member_argv, member_env
from tests.support import eventually_sync, process_state
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli
from tests.support.detection import detection_stack, incidents, member, step_of
from tests.support.paths import REPO
from tests.support.processes import parent_of
from tests.support.recovery import (
    LONG_STEPS,
    ROLLOUT_1_REPLACED,
    LogMark,
    end_after_recoveries,
    finish,
    recovered,
    recoveries,
    ride_out,
    runs_of,
    submit,
    wait_for_job_incident,
)
from tests.support.stack_template import template_pid

NO_MONITOR_GRACE_S = 6.0
"""The leader's `unreported_loss_after` in that test (15 s by default): more than the session
TTL (5 s)."""
ROLLOUT_0_REPLACED = ["FENCE rollout-0", "REQUEUE rollout-0", "REPLACE_ROLLOUT rollout-0"]
"""The recovery of a lost or hung rollout-0, as of rollout-1 (ROLLOUT_1_REPLACED)."""
# 2.5 x the stack's session TTL: every lease lapses.
ETCD_OUTAGE_S = 20.0

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


def step_seconds(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["time"], r["step_seconds"]) for r in rows if "step_seconds" in r]


def hang_rollout_0_until_replaced(stack: Cli, model_dir: Path, job: str) -> int:
    """Submit `job` (LONG_STEPS), SIGSTOP rollout-0 at step 3 and SIGCONT it once the
    leader replaced it: a zombie resumes. Its pid."""
    submit(stack, model_dir, job, "rollout.max_new_tokens=16", f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(stack, job) >= 3, timeout=180)
    pid = int(member(stack, "rollout-0")["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for_job_incident(stack, job, "ROLLOUT_HANG", "rollout-0", timeout=15)
        # Its recovery may not be listed yet when the incident is: no [0] of an empty list.
        eventually_sync(lambda: recovered(stack, job), timeout=90)
    finally:
        os.kill(pid, signal.SIGCONT)  # the zombie comes back after its replacement
    return pid


def test_a_hung_rollout_told_to_exit_when_fenced_exits_once_it_resumes(
    model_dir: Path, tmp_path: Path
) -> None:
    """EXIT_WHEN_FENCED, as compose and k8s set it: the zombie of a hung rollout, once it
    resumes and hears it was fenced, shuts down and exits (its supervisor would start it again
    as a new member) instead of staying registered as a member its job may not use."""
    env = {"ROBUSTRL_ROLLOUT_EXIT_WHEN_FENCED": "true"}
    with detection_stack(tmp_path, env=env) as stack:
        pid = hang_rollout_0_until_replaced(stack, model_dir, "hx")
        zombie_log = stack.home / "logs" / "rollout-0.log"
        eventually_sync(lambda: "rollout.exiting_fenced" in zombie_log.read_text(), timeout=30)

        def exited() -> bool:
            try:
                return process_state(pid) == "Z"  # exited; the stack that started it reaps it
            except FileNotFoundError:
                return True

        eventually_sync(exited, timeout=30)
        assert "rollout.stopped" in zombie_log.read_text()  # an orderly shutdown, not a crash
        assert all(m["instance_id"] != "rollout-0" for m in stack.members())
        steps = end_after_recoveries(stack, "hx")
        finish(stack, "hx")
        assert_nothing_lost_or_trained_twice(stack, "hx", tmp_path / "runs" / "hx", steps_run=steps)


def kill_rollout_1_with_nobody_to_replace_it(cli: Cli, model_dir: Path, job: str) -> None:
    """Submit `job` (LONG_STEPS), kill -9 rollout-1 at step 5, and check that the leader took
    up its loss but has nothing to start it with yet (no scheduler, or nobody started by
    hand)."""
    submit(cli, model_dir, job, f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(cli, job) >= 5, timeout=180)
    os.kill(int(member(cli, "rollout-1")["pid"]), signal.SIGKILL)
    wait_for_job_incident(cli, job, "MEMBER_LOST", "rollout-1", timeout=15)
    eventually_sync(lambda: bool(recoveries(cli, job)), timeout=15)
    assert not recoveries(cli, job)[0]["done_at"]


def test_an_external_scheduler_supplies_the_replacement_rollout(
    model_dir: Path, tmp_path: Path
) -> None:
    """`external` provisioner: the request waits for a scheduler; `robustrl provider`, started
    only after the failure, receives it and starts the member with the request's id."""
    started = tmp_path / "started"
    started.mkdir()
    command = (
        f"$ROBUSTRL_PROVISION_ARGV >{started}/$ROBUSTRL_PROVISION_INSTANCE_ID.log 2>&1 & "
        f"echo $! >{started}/$ROBUSTRL_PROVISION_INSTANCE_ID.pid; echo pid $!"
    )
    provider: subprocess.Popen[bytes] | None = None
    with detection_stack(tmp_path, "--provisioner", "external") as cli:
        try:
            # The job outlasts the provider and the member it starts (cold starts, a few
            # seconds each): it is ended only once the replacement serves it.
            kill_rollout_1_with_nobody_to_replace_it(cli, model_dir, "ex")
            assert list(started.iterdir()) == []
            provider = subprocess.Popen(
                cli.argv("provider", "--exec", command, "--name", "sim", "--roles", "rollout"),
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "provider.log").open("w"),
                env=cli.env,
                cwd=REPO,
            )
            eventually_sync(lambda: bool(recoveries(cli, "ex")[0]["done_at"]), timeout=120)
            steps = end_after_recoveries(cli, "ex")
            finish(cli, "ex")
            [rec] = recoveries(cli, "ex")
            assert rec["actions"] == ROLLOUT_1_REPLACED
            [replacement] = rec["replacements"]
            # The member that joined is the very process the scheduler's command started.
            pid = int((started / f"{replacement}.pid").read_text())
            assert member(cli, replacement)["pid"] == pid
            assert_nothing_lost_or_trained_twice(
                cli, "ex", tmp_path / "runs" / "ex", steps_run=steps
            )
        finally:
            if provider is not None:
                provider.kill()  # the provider we started, by pid
                provider.wait()
            for pid_file in started.glob("*.pid"):  # the members its command started
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_with_no_provisioner_a_rollout_started_by_hand_replaces_the_lost_one_but_not_under_its_id(
    model_dir: Path, tmp_path: Path
) -> None:
    """`none` provisioner, as docker-compose.yml and deploy/k8s run: the leader starts nothing,
    and binds the rollout an operator (here the test, as Docker's restart would) starts. One
    started under the lost rollout's id, as a container restarted in place with a fixed
    INSTANCE_ID would be, is never bound to the job its id is fenced from; one with the default
    id (drawn per process) is, and the job succeeds with nothing lost."""
    started: list[subprocess.Popen[bytes]] = []
    with detection_stack(tmp_path, "--provisioner", "none") as cli:
        state = StackState.load(cli.home)
        assert state is not None

        def start_rollout(instance_id: str, log: str) -> subprocess.Popen[bytes]:
            env = {**cli.env, **member_env(state.etcd_endpoints, state.prefix, "rollout", "")}
            if instance_id:
                env["ROBUSTRL_ROLLOUT_INSTANCE_ID"] = instance_id
            proc = subprocess.Popen(
                member_argv("rollout"),
                stdout=(tmp_path / log).open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
            started.append(proc)
            return proc

        def registered(pid: int) -> dict[str, Any] | None:
            return next((m for m in cli.members() if int(str(m["pid"])) == pid), None)

        def leader_logged(line: str) -> bool:
            logs = cli.home / "logs"
            return any(line in p.read_text() for p in logs.glob("coordinator-*.log"))

        try:
            # Two rollouts started by hand one after the other (cold starts) after the loss:
            # the job is ended only once the second serves it.
            kill_rollout_1_with_nobody_to_replace_it(cli, model_dir, "np")

            again = start_rollout("rollout-1", "rollout-1-again.log")
            eventually_sync(lambda: registered(again.pid) is not None, timeout=60)
            eventually_sync(
                lambda: leader_logged("coordinator.fenced_member_not_bound"), timeout=15
            )
            fresh = start_rollout("", "rollout-fresh.log")
            eventually_sync(lambda: bool(recoveries(cli, "np")[0]["done_at"]), timeout=90)
            steps = end_after_recoveries(cli, "np")
            finish(cli, "np")
            [rec] = recoveries(cli, "np")
            assert rec["actions"] == ROLLOUT_1_REPLACED
            replaced_by = registered(fresh.pid)
            assert replaced_by is not None and rec["replacements"] == [replaced_by["instance_id"]]
            assert str(replaced_by["instance_id"]).startswith("rollout-")
            restarted = registered(again.pid)
            assert restarted is not None and not restarted["job_id"], restarted
            assert again.poll() is None  # never told it was fenced: it is simply not bound
            assert_nothing_lost_or_trained_twice(
                cli, "np", tmp_path / "runs" / "np", steps_run=steps
            )
        finally:
            for proc in started:  # the processes this test started, by pid
                proc.kill()
                proc.wait()


def test_a_rollout_lost_while_no_monitor_runs_is_still_replaced(
    model_dir: Path, tmp_path: Path
) -> None:
    # Nobody saw it go: a monitor that starts later lists only the registered members. The
    # leader records the loss itself once the bound member stays missing from the registry
    # (coordinator `unreported_loss_after`); before, the job ran on with one rollout.
    grace = {"ROBUSTRL_COORDINATOR_UNREPORTED_LOSS_AFTER": str(NO_MONITOR_GRACE_S)}
    with detection_stack(tmp_path, env=grace) as stack:
        submit(stack, model_dir, "nm", f"trainer.steps={LONG_STEPS}")
        eventually_sync(lambda: step_of(stack, "nm") >= 5, timeout=180)
        os.kill(int(member(stack, "monitor-0")["pid"]), signal.SIGKILL)
        eventually_sync(
            lambda: all(m["instance_id"] != "monitor-0" for m in stack.members()), timeout=30
        )
        os.kill(int(member(stack, "rollout-1")["pid"]), signal.SIGKILL)
        steps = end_after_recoveries(stack, "nm")
        finish(stack, "nm")
        [rec] = recoveries(stack, "nm")
        assert rec["actions"] == ROLLOUT_1_REPLACED
        assert rec["done_at"] and rec["replacements"][0].startswith("rollout-p")
        [incident] = incidents(stack, "nm")
        assert (
            incident["kind"] == "MEMBER_LOST" and "no monitor reported it" in incident["evidence"]
        )
        assert_nothing_lost_or_trained_twice(stack, "nm", tmp_path / "runs" / "nm", steps_run=steps)


# The shared stack's tests, in the order they run on it. The etcd outage leaves every member as
# it was. The hung rollout-0 stays fenced and a replacement joins: trainer-0 and rollout-1 serve
# the next job. The killed rollout-1 is replaced too, and the poison group only needs some
# rollouts, whatever their names.


def test_etcd_unreachable_for_longer_than_the_ttl_replaces_nothing_and_loses_nothing(
    stack: Cli, model_dir: Path
) -> None:
    # The failure table's last row. Every lease lapses when etcd answers again, while every
    # heartbeat stream (to the monitor, not through etcd) went on: nobody is lost. Before,
    # the trainer and both rollouts died on their first etcd error, and the monitor reported
    # every member lost.
    def outage() -> None:
        state = json.loads((stack.home / "stack.json").read_text())
        etcd_pid = next(int(p["pid"]) for p in state["procs"] if p["name"] == "etcd")
        os.kill(etcd_pid, signal.SIGSTOP)  # the etcd this test's stack started
        try:
            time.sleep(ETCD_OUTAGE_S)  # the outage under test, not a wait: it outlasts every lease
        finally:
            os.kill(etcd_pid, signal.SIGCONT)

    logs = ride_out(stack, model_dir, "eu", outage)
    # The outage outlasted the leases (else this test would prove nothing)...
    lapsed = [
        line
        for line in logs.since("monitor-0.log").splitlines()
        if "monitor.lease_lapsed_while_beating" in line
    ]
    assert any("member=trainer-0" in line for line in lapsed), lapsed
    # ...and the trainer waited instead of failing: on etcd itself (publish), on the leader,
    # which cannot write (its report), or for trajectories (no rollout can lease), as the
    # outage happens to find it. The first two waits are logged; the third is not.
    assert "trainer.failed" not in logs.since("trainer-0.log")


def test_a_hung_rollout_is_replaced_and_its_zombie_changes_nothing(
    stack: Cli, model_dir: Path
) -> None:
    logs = LogMark(stack)
    hang_rollout_0_until_replaced(stack, model_dir, "rh")
    # It learns from its next beat that it was fenced, and stops its work.
    eventually_sync(lambda: "rollout.fenced" in logs.since("rollout-0.log"), timeout=30)
    # And it leaves the job in the registry at once, so the leader never waits on it.
    # (Its record may be missing for a moment: its lease expired while it was stopped, and
    # it registers again after SIGCONT.)
    eventually_sync(
        lambda: any(m["instance_id"] == "rollout-0" and not m["job_id"] for m in stack.members()),
        timeout=15,
    )
    steps = end_after_recoveries(stack, "rh")
    finish(stack, "rh")
    status = stack.json("status", "rh")
    assert isinstance(status, dict)
    # What `status` tells a user: the job succeeded at its budget, and the hang was recovered by
    # replacing rollout-0 with a new rollout, the one recovery of the job.
    assert status["phase"] == "SUCCEEDED" and status["step"] == steps, status
    [rec] = status["recoveries"]
    assert (rec["kind"], rec["instance_id"]) == ("ROLLOUT_HANG", "rollout-0"), rec
    assert rec["actions"] == ROLLOUT_0_REPLACED and rec["done_at"], rec
    assert [r[: len("rollout-p")] for r in rec["replacements"]] == ["rollout-p"], rec
    assert_nothing_lost_or_trained_twice(stack, "rh", runs_of(stack) / "rh", steps_run=steps)


def test_a_killed_rollout_is_replaced_and_the_trainer_never_pauses(
    stack: Cli, model_dir: Path
) -> None:
    submit(stack, model_dir, "rc", f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(stack, "rc") >= 5, timeout=180)
    os.kill(int(member(stack, "rollout-1")["pid"]), signal.SIGKILL)
    killed_at = time.time()
    wait_for_job_incident(stack, "rc", "MEMBER_LOST", "rollout-1", timeout=15)
    steps = end_after_recoveries(stack, "rc")
    finish(stack, "rc")
    [rec] = recoveries(stack, "rc")
    assert rec["actions"] == ROLLOUT_1_REPLACED
    assert rec["done_at"] and rec["replacements"][0].startswith("rollout-p")
    assert member(stack, "trainer-0")  # the trainer was never replaced
    # The leader forked the replacement from the stack's template (no imports of its own).
    state = StackState.load(stack.home)
    assert state is not None
    template = template_pid(state)
    assert parent_of(int(member(stack, rec["replacements"][0])["pid"])) == template
    run = runs_of(stack) / "rc"
    assert_nothing_lost_or_trained_twice(stack, "rc", run, steps_run=steps)
    # The trainer kept stepping through the recovery, at its normal pace or near it, also
    # while the replacement was bound (the step ending just after it included): a BIND that
    # loaded the model under the job's lock once stalled every lease for ~2 s.
    timings = step_seconds(run)
    before = [s for t, s in timings if t < killed_at]
    during = [s for t, s in timings if killed_at <= t <= rec["done_at"] + 1.0]
    assert during, "the trainer made no step while the rollout was being replaced"
    assert max(during) <= 3 * statistics.median(before) + 1.0, (before, during)


def test_a_group_that_crashes_every_rollout_is_dropped_and_the_job_goes_on(
    stack: Cli, model_dir: Path
) -> None:
    # A poison prompt (spec.faults.crash_groups: every rollout that generates group 12
    # crashes): each crash is a lost rollout, replaced; after its third the group is dropped.
    # Before, it was leased again for ever, taking down one rollout after another.
    submit(stack, model_dir, "pg", f"trainer.steps={LONG_STEPS}", "faults.crash_groups=[12]")
    steps = end_after_recoveries(stack, "pg", 3)
    finish(stack, "pg")
    poison = "pg-g000012"
    lost = recoveries(stack, "pg")
    assert len(lost) == 3 and all(r["kind"] == "MEMBER_LOST" for r in lost), lost
    assert all(r["actions"][-1].startswith("REPLACE_ROLLOUT") for r in lost), lost
    dropped = stack.json("dropped", "pg")
    assert isinstance(dropped, dict)
    assert dropped[poison].startswith("poison group: lost 3 holders"), dropped
    # Leased alone after its first loss: no other group was dropped with it.
    assert [g for g, why in dropped.items() if "poison" in why] == [poison]
    crashed = [
        log.name
        for log in (stack.home / "logs").glob("rollout-*.log")
        if f"generating group {poison}" in log.read_text()
    ]
    assert len(crashed) == 3, crashed
    assert_nothing_lost_or_trained_twice(stack, "pg", runs_of(stack) / "pg", steps_run=steps)
