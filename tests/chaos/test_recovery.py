"""Recover only the failed role, against real processes: each fault is injected into a
running job, the job still succeeds, no trajectory is trained twice, and every prompt group
is trained or accounted for."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from robustrl.cli.stack import StackState
from robustrl.cli.stack_commands import DEFAULT_STANDBY_NICE
from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.core.config import member_argv, member_env
from robustrl.core.processes import may_raise_priority
from services.trainer import checkpoint
from tests.support import eventually_sync, process_state
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, chaos
from tests.support.detection import (
    detection_stack,
    incidents,
    member,
    step_of,
    wait_for_incident,
)
from tests.support.paths import EXAMPLE, REPO
from tests.support.processes import thread_niceness

STEPS = 80
# Jobs that must outlast a recovery: at 80 steps the surviving rollout finished the job before
# its replacement (a cold process start, 6-8 s on two cores) was up. Each long job is about
# twice (or more) the step at which its recovery completed on two cores (measured at ~5.5
# steps/s: rollout killed 77, rollout hung 105, standby took over 55, external scheduler 161),
# not more: every step after that only adds to the suite's time. Since holders stopped
# polling (41126c4) these jobs run ~9.5 steps/s, so the margins are thinner than they were;
# the job with the longest recovery, no monitor's, failed so (below).
KILLED_ROLLOUT_STEPS = 240
HUNG_ROLLOUT_STEPS = 260
STANDBY_STEPS = 200
EXTERNAL_STEPS = 320
BOTH_KILLED_STEPS = 160
ETCD_OUTAGE_STEPS = 160
NOSPACE_STEPS = 120
NO_MONITOR_STEPS = 400
TRAINER_ERROR_STEPS = 160
NO_PROVISIONER_STEPS = 400
"""Two rollouts started by hand one after the other (cold starts) after the loss."""
NO_MONITOR_GRACE_S = 6.0
"""The leader's `unreported_loss_after` in that test (15 s by default): more than the session
TTL (5 s). With 15 s and 320 steps the job ended 2 s after the loss was recorded, before the
replacement was up (the recovery then never completes); now it completes near step 200."""
ROLLOUT_1_REPLACED = ["FENCE rollout-1", "REQUEUE rollout-1", "REPLACE_ROLLOUT rollout-1"]
"""The recovery of a lost rollout-1: fenced, its leases taken back, a new rollout asked for."""
# 2.5 x the stack's session TTL: every lease lapses.
ETCD_OUTAGE_S = 20.0

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Cli]:
    with detection_stack(tmp_path) as cli:
        yield cli


def submit(cli: Cli, model_dir: Path, job: str, *overrides: str) -> None:
    cli.run(
        "submit",
        str(EXAMPLE),
        "--id",
        job,
        f"model.path={model_dir}",
        f"trainer.steps={STEPS}",
        "trainer.groups_per_step=8",
        "trainer.eval_every=1000",
        *overrides,
    )


def finish(cli: Cli, job: str) -> dict[str, Any]:
    watch = cli.run("watch", job, check=False, timeout=360)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    status = cli.json("status", job)
    assert isinstance(status, dict) and status["phase"] == "SUCCEEDED", status
    return status


def recoveries(cli: Cli, job: str) -> list[dict[str, Any]]:
    status = cli.json("status", job)
    assert isinstance(status, dict)
    return list(status["recoveries"])


def pids(cli: Cli, *instance_ids: str) -> dict[str, int]:
    """These members' pids, read in one command. Tests read them before they wait for the job's
    step: every command is a cold process start (seconds on two busy cores, ~10 steps a
    second), and a job of STEPS once ended between the wait and the fault."""
    members = {m["instance_id"]: m for m in cli.members()}
    return {name: int(str(members[name]["pid"])) for name in instance_ids}


def data_plane_pids(cli: Cli) -> dict[object, object]:
    """Trainer and rollout members by instance id -> their pid."""
    return {
        m["instance_id"]: m["pid"] for m in cli.members() if m["role"] in ("trainer", "rollout")
    }


def step_seconds(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["time"], r["step_seconds"]) for r in rows if "step_seconds" in r]


def test_a_killed_rollout_is_replaced_and_the_trainer_never_pauses(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    submit(stack, model_dir, "rc", f"trainer.steps={KILLED_ROLLOUT_STEPS}")
    eventually_sync(lambda: step_of(stack, "rc") >= 5, timeout=180)
    os.kill(int(member(stack, "rollout-1")["pid"]), signal.SIGKILL)
    killed_at = time.time()
    wait_for_incident(stack, "MEMBER_LOST", "rollout-1", timeout=15)
    finish(stack, "rc")
    [rec] = recoveries(stack, "rc")
    assert rec["actions"] == ROLLOUT_1_REPLACED
    assert rec["done_at"] and rec["replacements"][0].startswith("rollout-p")
    assert member(stack, "trainer-0")  # the trainer was never replaced
    run = tmp_path / "runs" / "rc"
    assert_nothing_lost_or_trained_twice(stack, "rc", run, steps_run=KILLED_ROLLOUT_STEPS)
    # The trainer kept stepping through the recovery, at its normal pace or near it, also
    # while the replacement was bound (the step ending just after it included): a BIND that
    # loaded the model under the job's lock once stalled every lease for ~2 s.
    timings = step_seconds(run)
    before = [s for t, s in timings if t < killed_at]
    during = [s for t, s in timings if killed_at <= t <= rec["done_at"] + 1.0]
    assert during, "the trainer made no step while the rollout was being replaced"
    assert max(during) <= 3 * statistics.median(before) + 1.0, (before, during)


def hang_rollout_0_until_replaced(stack: Cli, model_dir: Path, job: str) -> int:
    """Submit `job` (HUNG_ROLLOUT_STEPS), SIGSTOP rollout-0 at step 3 and SIGCONT it once the
    leader replaced it: a zombie resumes. Its pid."""
    submit(
        stack, model_dir, job, "rollout.max_new_tokens=16", f"trainer.steps={HUNG_ROLLOUT_STEPS}"
    )
    eventually_sync(lambda: step_of(stack, job) >= 3, timeout=180)
    pid = int(member(stack, "rollout-0")["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for_incident(stack, "ROLLOUT_HANG", "rollout-0", timeout=15)
        eventually_sync(lambda: bool(recoveries(stack, job)[0]["done_at"]), timeout=90)
    finally:
        os.kill(pid, signal.SIGCONT)  # the zombie comes back after its replacement
    return pid


def test_a_hung_rollout_is_replaced_and_its_zombie_changes_nothing(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    hang_rollout_0_until_replaced(stack, model_dir, "rh")
    # It learns from its next beat that it was fenced, and stops its work.
    zombie_log = stack.home / "logs" / "rollout-0.log"
    eventually_sync(lambda: "rollout.fenced" in zombie_log.read_text(), timeout=30)
    # And it leaves the job in the registry at once, so the leader never waits on it.
    # (Its record may be missing for a moment: its lease expired while it was stopped, and
    # it registers again after SIGCONT.)
    eventually_sync(
        lambda: any(m["instance_id"] == "rollout-0" and not m["job_id"] for m in stack.members()),
        timeout=15,
    )
    finish(stack, "rh")
    status = stack.json("status", "rh")
    assert isinstance(status, dict)
    assert_nothing_lost_or_trained_twice(
        stack, "rh", tmp_path / "runs" / "rh", steps_run=HUNG_ROLLOUT_STEPS
    )


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
        finish(stack, "hx")
        assert_nothing_lost_or_trained_twice(
            stack, "hx", tmp_path / "runs" / "hx", steps_run=HUNG_ROLLOUT_STEPS
        )


def test_a_trainer_and_a_rollout_killed_together_lose_no_group(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    # As when one machine carries both: the groups the rollout delivered that the trainer had
    # not made durable are held by nobody. They must be generated again, not counted trained.
    victims = pids(stack, "trainer-0", "rollout-1")
    submit(stack, model_dir, "tr", f"trainer.steps={BOTH_KILLED_STEPS}")
    eventually_sync(lambda: step_of(stack, "tr") >= 8, timeout=180)
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    wait_for_incident(stack, "MEMBER_LOST", "trainer-0", timeout=15)
    wait_for_incident(stack, "MEMBER_LOST", "rollout-1", timeout=15)
    finish(stack, "tr")
    recovered = {r["instance_id"]: r for r in recoveries(stack, "tr")}
    assert sorted(recovered) == ["rollout-1", "trainer-0"]
    # With no standby, the trainer's checkpoint is restored on a new one the provisioner starts.
    trainer = recovered["trainer-0"]
    assert trainer["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
    assert trainer["replacements"][0].startswith("trainer-p")
    assert_nothing_lost_or_trained_twice(
        stack, "tr", tmp_path / "runs" / "tr", steps_run=BOTH_KILLED_STEPS
    )


def test_a_killed_trainer_is_taken_over_by_a_standby_that_built_the_model_ahead(
    tmp_path: Path, model_dir: Path
) -> None:
    with detection_stack(tmp_path, "--standby-trainers", "1") as cli:
        submit(cli, model_dir, "tw", f"trainer.steps={STANDBY_STEPS}")
        # The leader has the free standby build this job's model while the job runs.
        eventually_sync(
            lambda: member(cli, "standby-0")["labels"].get("prepared") == "tw", timeout=120
        )
        before = pids(cli, "trainer-0", "rollout-0", "rollout-1", "standby-0")
        trainer, standby = before.pop("trainer-0"), before.pop("standby-0")
        # It built the model at `up`'s standby niceness (where it may go back, as here).
        yielding = DEFAULT_STANDBY_NICE if may_raise_priority(0) else 0
        assert thread_niceness(standby) == {yielding}
        eventually_sync(lambda: step_of(cli, "tw") >= 8, timeout=180)
        os.kill(trainer, signal.SIGKILL)
        incident = wait_for_incident(cli, "MEMBER_LOST", "trainer-0", timeout=15)
        # Its address refused connections: reported without waiting out the reconnect grace.
        assert "refuses connections" in incident["evidence"], incident
        finish(cli, "tw")
        [rec] = recoveries(cli, "tw")
        assert rec["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
        assert rec["replacements"] == ["standby-0"]
        log = (tmp_path / "home" / "logs" / "standby-0.log").read_text()
        assert "trainer.prepared" in log and "trainer.took_prepared" in log
        assert "trainer.restored" in log
        assert thread_niceness(standby) == {0}  # bound: back to its start niceness
        assert ("trainer.priority_restored" in log) == bool(yielding)
        # Only the trainer was replaced: the same rollout processes served the whole job.
        assert pids(cli, "rollout-0", "rollout-1") == before
        assert_nothing_lost_or_trained_twice(cli, "tw", tmp_path / "runs" / "tw", STANDBY_STEPS)


def test_a_hung_trainer_is_replaced_and_its_zombie_changes_nothing(
    tmp_path: Path, model_dir: Path
) -> None:
    """A trainer frozen mid-job (SIGSTOP: mid-step, and most likely mid-write, since a
    checkpoint is written every step) is replaced by the standby, then comes back. It learns
    it was fenced and leaves the job, and nothing of it reaches the job: its replacement
    claimed the checkpoint folder before restoring (`checkpoints/owner`), so the zombie's
    checkpoint and run-log lines are not published, and every step is trained once."""
    with detection_stack(tmp_path, "--standby-trainers", "1") as cli:
        # The job stands still while its only trainer is frozen: STEPS outlast the recovery.
        pid = pids(cli, "trainer-0")["trainer-0"]
        submit(cli, model_dir, "th")
        eventually_sync(lambda: step_of(cli, "th") >= 8, timeout=180)
        os.kill(pid, signal.SIGSTOP)
        try:
            eventually_sync(lambda: any(r["done_at"] for r in recoveries(cli, "th")), timeout=90)
        finally:
            os.kill(pid, signal.SIGCONT)  # the zombie comes back after its replacement
        zombie_log = tmp_path / "home" / "logs" / "trainer-0.log"
        eventually_sync(lambda: "trainer.fenced" in zombie_log.read_text(), timeout=30)
        finish(cli, "th")
        [rec] = recoveries(cli, "th")
        assert rec["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
        assert rec["replacements"] == ["standby-0"]
        run = tmp_path / "runs" / "th"
        owner = checkpoint.owner_epoch(run / "checkpoints")
        assert owner is not None and owner > FIRST_EPOCH, "the replacement's epoch owns them"
        assert "Traceback" not in zombie_log.read_text()
        assert_nothing_lost_or_trained_twice(cli, "th", run, STEPS)


def test_a_full_restart_replaces_every_role_with_a_new_process(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    survivors = pids(stack, "trainer-0", "rollout-0", "rollout-1")
    killed = survivors.pop("rollout-1")
    submit(stack, model_dir, "fr", "recovery.mode=full_restart")
    eventually_sync(lambda: step_of(stack, "fr") >= 8, timeout=180)
    os.kill(killed, signal.SIGKILL)
    wait_for_incident(stack, "MEMBER_LOST", "rollout-1", timeout=15)
    finish(stack, "fr")
    [rec] = recoveries(stack, "fr")
    assert rec["actions"] == ["FULL_RESTART"]
    # The members that did not fail were not rebound: their processes exited, and new ones
    # (started by the provisioner) took every role.
    assert sorted(r[: len("rollout-p")] for r in rec["replacements"]) == [
        "rollout-p",
        "rollout-p",
        "trainer-p",
    ]
    for name, pid in survivors.items():
        eventually_sync(functools.partial(exited, pid), timeout=15)
        assert name not in [m["instance_id"] for m in stack.members()]
        assert "exiting" in (stack.home / "logs" / f"{name}.log").read_text()
    assert_nothing_lost_or_trained_twice(stack, "fr", tmp_path / "runs" / "fr", STEPS)


def exited(pid: int) -> bool:
    """Gone, or exited and not reaped yet (a zombie)."""
    try:
        return process_state(pid) == "Z"
    except FileNotFoundError:
        return True


def test_a_nan_loss_is_rolled_back_without_replacing_anything(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    submit(stack, model_dir, "tn", "faults.nan_loss_steps=[6]")
    finish(stack, "tn")
    [rec] = recoveries(stack, "tn")
    assert rec["kind"] == "NON_FINITE" and rec["actions"] == ["ROLLBACK trainer-0"]
    assert not rec["replacements"]
    assert [i["kind"] for i in incidents(stack, "tn")] == ["NON_FINITE"]
    assert_nothing_lost_or_trained_twice(stack, "tn", tmp_path / "runs" / "tn", STEPS)


def test_a_group_that_crashes_every_rollout_is_dropped_and_the_job_goes_on(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    # A poison prompt (spec.faults.crash_groups: every rollout that generates group 12
    # crashes): each crash is a lost rollout, replaced; after its third the group is dropped.
    # Before, it was leased again for ever, taking down one rollout after another.
    submit(stack, model_dir, "pg", "trainer.steps=40", "faults.crash_groups=[12]")
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
        for log in (tmp_path / "home" / "logs").glob("rollout-*.log")
        if f"generating group {poison}" in log.read_text()
    ]
    assert len(crashed) == 3, crashed
    assert_nothing_lost_or_trained_twice(stack, "pg", tmp_path / "runs" / "pg", steps_run=40)


def test_a_killed_leader_coordinator_restarts_no_data_plane_role(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    data_plane = data_plane_pids(stack)
    leader = next(m for m in stack.members() if m["leader"])
    submit(stack, model_dir, "lc")
    eventually_sync(lambda: step_of(stack, "lc") >= 5, timeout=180)
    os.kill(int(str(leader["pid"])), signal.SIGKILL)
    finish(stack, "lc")
    after = data_plane_pids(stack)
    assert after == data_plane
    assert recoveries(stack, "lc") == []
    assert_nothing_lost_or_trained_twice(stack, "lc", tmp_path / "runs" / "lc", STEPS)


def kill_rollout_1_with_nobody_to_replace_it(
    cli: Cli, model_dir: Path, job: str, steps: int
) -> None:
    """Submit `job`, kill -9 rollout-1 at step 5, and check that the leader took up its loss
    but has nothing to start it with yet (no scheduler, or nobody started by hand)."""
    submit(cli, model_dir, job, f"trainer.steps={steps}")
    eventually_sync(lambda: step_of(cli, job) >= 5, timeout=180)
    os.kill(int(member(cli, "rollout-1")["pid"]), signal.SIGKILL)
    wait_for_incident(cli, "MEMBER_LOST", "rollout-1", timeout=15)
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
            # Long enough that the one rollout left cannot finish the job before the provider
            # and the member it starts are up (cold starts, a few seconds each).
            kill_rollout_1_with_nobody_to_replace_it(cli, model_dir, "ex", EXTERNAL_STEPS)
            assert list(started.iterdir()) == []
            provider = subprocess.Popen(
                cli.argv("provider", "--exec", command, "--name", "sim", "--roles", "rollout"),
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "provider.log").open("w"),
                env=cli.env,
                cwd=REPO,
            )
            eventually_sync(lambda: bool(recoveries(cli, "ex")[0]["done_at"]), timeout=120)
            finish(cli, "ex")
            [rec] = recoveries(cli, "ex")
            assert rec["actions"] == ROLLOUT_1_REPLACED
            [replacement] = rec["replacements"]
            # The member that joined is the very process the scheduler's command started.
            pid = int((started / f"{replacement}.pid").read_text())
            assert member(cli, replacement)["pid"] == pid
            assert_nothing_lost_or_trained_twice(
                cli, "ex", tmp_path / "runs" / "ex", steps_run=EXTERNAL_STEPS
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
            kill_rollout_1_with_nobody_to_replace_it(cli, model_dir, "np", NO_PROVISIONER_STEPS)

            again = start_rollout("rollout-1", "rollout-1-again.log")
            eventually_sync(lambda: registered(again.pid) is not None, timeout=60)
            eventually_sync(
                lambda: leader_logged("coordinator.fenced_member_not_bound"), timeout=15
            )
            fresh = start_rollout("", "rollout-fresh.log")
            eventually_sync(lambda: bool(recoveries(cli, "np")[0]["done_at"]), timeout=90)
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
                cli, "np", tmp_path / "runs" / "np", steps_run=NO_PROVISIONER_STEPS
            )
        finally:
            for proc in started:  # the processes this test started, by pid
                proc.kill()
                proc.wait()


def ride_out(
    stack: Cli, model_dir: Path, tmp_path: Path, job: str, steps: int, trouble: Callable[[], None]
) -> Path:
    """Submit `job`, make `trouble` once it reaches step 8, and check that the job rode it out:
    it succeeded with the same trainer and rollouts, no incident and no recovery, nothing lost
    or trained twice. The stack's log folder."""
    submit(stack, model_dir, job, f"trainer.steps={steps}")
    eventually_sync(lambda: step_of(stack, job) >= 8, timeout=180)
    data_plane = data_plane_pids(stack)
    trouble()
    finish(stack, job)
    assert incidents(stack, job) == []
    assert recoveries(stack, job) == []
    assert data_plane_pids(stack) == data_plane
    assert_nothing_lost_or_trained_twice(stack, job, tmp_path / "runs" / job, steps_run=steps)
    return stack.home / "logs"


def test_etcd_unreachable_for_longer_than_the_ttl_replaces_nothing_and_loses_nothing(
    stack: Cli, model_dir: Path, tmp_path: Path
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

    logs = ride_out(stack, model_dir, tmp_path, "eu", ETCD_OUTAGE_STEPS, outage)
    # The outage outlasted the leases (else this test would prove nothing)...
    lapsed = [
        line
        for line in (logs / "monitor-0.log").read_text().splitlines()
        if "monitor.lease_lapsed_while_beating" in line
    ]
    assert any("member=trainer-0" in line for line in lapsed), lapsed
    # ...and the trainer waited instead of failing: on etcd itself (publish), on the leader,
    # which cannot write (its report), or for trajectories (no rollout can lease), as the
    # outage happens to find it. The first two waits are logged; the third is not.
    assert "trainer.failed" not in (logs / "trainer-0.log").read_text()


def test_an_etcd_out_of_space_is_freed_by_the_leader_and_the_job_goes_on(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    # NOSPACE raised mid-job (etcd's own alarm, as a full quota raises it): etcd refuses
    # every write, so no lease, completion or step record lands. Before, the job stopped
    # there until a person disarmed the alarm (and its trainer stopped on the leader's
    # UNKNOWN answer). The leader frees etcd within its check interval (5 s).
    import aetcd
    from aetcd import rpc

    host, port = json.loads((stack.home / "stack.json").read_text())["etcd_endpoints"].split(":")

    async def raise_nospace() -> list[int]:
        async with aetcd.Client(host=host, port=int(port)) as client:
            await client.create_alarm()
            return [a.alarm_type async for a in client.list_alarms()]

    def nospace() -> None:
        assert asyncio.run(raise_nospace()) == [rpc.NOSPACE]

    logs = ride_out(stack, model_dir, tmp_path, "ns", NOSPACE_STEPS, nospace)
    coordinator_logs = "".join(p.read_text() for p in logs.glob("coordinator-*.log"))
    assert "etcd.space_recovered" in coordinator_logs
    assert "trainer.failed" not in (logs / "trainer-0.log").read_text()


def test_a_rollout_lost_while_no_monitor_runs_is_still_replaced(
    model_dir: Path, tmp_path: Path
) -> None:
    # Nobody saw it go: a monitor that starts later lists only the registered members. The
    # leader records the loss itself once the bound member stays missing from the registry
    # (coordinator `unreported_loss_after`); before, the job ran on with one rollout.
    grace = {"ROBUSTRL_COORDINATOR_UNREPORTED_LOSS_AFTER": str(NO_MONITOR_GRACE_S)}
    with detection_stack(tmp_path, env=grace) as stack:
        submit(stack, model_dir, "nm", f"trainer.steps={NO_MONITOR_STEPS}")
        eventually_sync(lambda: step_of(stack, "nm") >= 5, timeout=180)
        os.kill(int(member(stack, "monitor-0")["pid"]), signal.SIGKILL)
        eventually_sync(
            lambda: all(m["instance_id"] != "monitor-0" for m in stack.members()), timeout=30
        )
        os.kill(int(member(stack, "rollout-1")["pid"]), signal.SIGKILL)
        finish(stack, "nm")
        [rec] = recoveries(stack, "nm")
        assert rec["actions"] == ROLLOUT_1_REPLACED
        assert rec["done_at"] and rec["replacements"][0].startswith("rollout-p")
        [incident] = incidents(stack, "nm")
        assert (
            incident["kind"] == "MEMBER_LOST" and "no monitor reported it" in incident["evidence"]
        )
        assert_nothing_lost_or_trained_twice(
            stack, "nm", tmp_path / "runs" / "nm", steps_run=NO_MONITOR_STEPS
        )


def test_a_trainer_error_is_recovered_on_another_trainer_and_the_same_error_again_fails_the_job(
    stack: Cli, model_dir: Path, tmp_path: Path
) -> None:
    # A fault of one trainer's machine (chaos INJECT_ERROR: that trainer alone stops on an
    # error at one step): recovered as a lost trainer, and the job succeeds. Before, any error
    # of the trainer failed the whole job.
    rollout_pids = pids(stack, "rollout-0", "rollout-1")
    # Long enough that the job still runs when the fault arrives: the chaos command is a cold
    # process start (with 80 steps, and two more commands between the wait and the fault, the
    # job once ended first).
    submit(stack, model_dir, "te", f"trainer.steps={TRAINER_ERROR_STEPS}")
    eventually_sync(lambda: step_of(stack, "te") >= 4, timeout=180)
    [injected] = chaos(stack, "te", "--fault", "error", "--role", "trainer")
    assert (injected["fault"], injected["instance_id"]) == ("error", "trainer-0")
    incident = wait_for_incident(stack, "TRAINER_ERROR", "trainer-0", timeout=60)
    failed_at = injected["step"] - 1  # steps done when step `injected["step"]` failed
    assert f"stopped at step {failed_at} on an error: InjectedError" in incident["evidence"]
    finish(stack, "te")
    [rec] = recoveries(stack, "te")
    assert rec["kind"] == "TRAINER_ERROR"
    assert rec["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
    assert rec["replacements"][0].startswith("trainer-p")
    assert pids(stack, "rollout-0", "rollout-1") == rollout_pids
    # The fenced trainer lives on, off the job: the leader does not find it bound any more.
    fenced = member(stack, "trainer-0")
    assert fenced["job_id"] == "" and fenced["labels"].get("fenced") == "true", fenced
    assert_nothing_lost_or_trained_twice(
        stack, "te", tmp_path / "runs" / "te", steps_run=TRAINER_ERROR_STEPS
    )

    # An error of the job itself (spec.faults.error_steps: every trainer stops at step 5):
    # recovered once, then the replacement stops at the same step and the job fails, saying
    # why, instead of replacing trainers for ever.
    submit(stack, model_dir, "tf", "faults.error_steps=[5]")
    watch = stack.run("watch", "tf", check=False, timeout=240)
    assert watch.returncode != 0
    status = stack.json("status", "tf")
    assert isinstance(status, dict) and status["phase"] == "FAILED", status
    assert "InjectedError: step 5 failed" in status["message"], status["message"]
    assert "the error is the job's" in status["message"], status["message"]
    [first] = recoveries(stack, "tf")
    assert first["kind"] == "TRAINER_ERROR" and first["done_at"]
    assert [i["kind"] for i in incidents(stack, "tf")] == ["TRAINER_ERROR"]
