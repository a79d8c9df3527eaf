"""Recover only the failed role, against real processes (as test_recovery.py): this file has
the trainer's faults (killed, hung, a NaN loss, an error of its machine or of the job), the
full-restart baseline, a leader coordinator killed and etcd out of space.

Each job is ended relative to the recovery it tests (`robustrl update`, a few steps past the
recovery's end). The tests that start their stack as `up` starts it by default and leave it
usable share one (`shared_stack`, last in the file)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
from pathlib import Path

import pytest

from robustrl.cli.stack_commands import DEFAULT_STANDBY_NICE
from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.core.processes import may_raise_priority
from services.trainer import checkpoint
from tests.support import eventually_sync
from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli, chaos
from tests.support.detection import (
    detection_stack,
    incidents,
    member,
    step_of,
    wait_for_incident,
)
from tests.support.processes import exited, thread_niceness
from tests.support.recovery import (
    LONG_STEPS,
    data_plane_pids,
    end_after,
    end_after_recoveries,
    finish,
    pids,
    recoveries,
    ride_out,
    runs_of,
    submit,
    wait_for_job_incident,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_killed_trainer_is_taken_over_by_a_standby_that_built_the_model_ahead(
    tmp_path: Path, model_dir: Path
) -> None:
    with detection_stack(tmp_path, "--standby-trainers", "1") as cli:
        submit(cli, model_dir, "tw", f"trainer.steps={LONG_STEPS}")
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
        steps = end_after_recoveries(cli, "tw")
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
        assert_nothing_lost_or_trained_twice(cli, "tw", tmp_path / "runs" / "tw", steps)


def test_a_hung_trainer_is_replaced_and_its_zombie_changes_nothing(
    tmp_path: Path, model_dir: Path
) -> None:
    """A trainer frozen mid-job (SIGSTOP: mid-step, and most likely mid-write, since a
    checkpoint is written every step) is replaced by the standby, then comes back. It learns
    it was fenced and leaves the job, and nothing of it reaches the job: its replacement
    claimed the checkpoint folder before restoring (`checkpoints/owner`), so the zombie's
    checkpoint and run-log lines are not published, and every step is trained once."""
    with detection_stack(tmp_path, "--standby-trainers", "1") as cli:
        pid = pids(cli, "trainer-0")["trainer-0"]
        submit(cli, model_dir, "th", f"trainer.steps={LONG_STEPS}")
        eventually_sync(lambda: step_of(cli, "th") >= 8, timeout=180)
        os.kill(pid, signal.SIGSTOP)
        try:
            eventually_sync(lambda: any(r["done_at"] for r in recoveries(cli, "th")), timeout=90)
        finally:
            os.kill(pid, signal.SIGCONT)  # the zombie comes back after its replacement
        zombie_log = tmp_path / "home" / "logs" / "trainer-0.log"
        eventually_sync(lambda: "trainer.fenced" in zombie_log.read_text(), timeout=30)
        steps = end_after_recoveries(cli, "th")
        finish(cli, "th")
        [rec] = recoveries(cli, "th")
        assert rec["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
        assert rec["replacements"] == ["standby-0"]
        run = tmp_path / "runs" / "th"
        owner = checkpoint.owner_epoch(run / "checkpoints")
        assert owner is not None and owner > FIRST_EPOCH, "the replacement's epoch owns them"
        assert "Traceback" not in zombie_log.read_text()
        assert_nothing_lost_or_trained_twice(cli, "th", run, steps)


def test_a_full_restart_replaces_every_role_with_a_new_process(
    model_dir: Path, tmp_path: Path
) -> None:
    # Its own stack: every member of it is replaced.
    with detection_stack(tmp_path) as stack:
        survivors = pids(stack, "trainer-0", "rollout-0", "rollout-1")
        killed = survivors.pop("rollout-1")
        submit(stack, model_dir, "fr", "recovery.mode=full_restart", f"trainer.steps={LONG_STEPS}")
        eventually_sync(lambda: step_of(stack, "fr") >= 8, timeout=180)
        os.kill(killed, signal.SIGKILL)
        wait_for_incident(stack, "MEMBER_LOST", "rollout-1", timeout=15)
        steps = end_after_recoveries(stack, "fr")
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
        assert_nothing_lost_or_trained_twice(stack, "fr", tmp_path / "runs" / "fr", steps)


def test_a_trainer_error_is_recovered_on_another_trainer_and_the_same_error_again_fails_the_job(
    model_dir: Path, tmp_path: Path
) -> None:
    # A fault of one trainer's machine (chaos INJECT_ERROR: that trainer alone stops on an
    # error at one step): recovered as a lost trainer, and the job succeeds. Before, any error
    # of the trainer failed the whole job. Its own stack: trainer-0 is fenced for good.
    with detection_stack(tmp_path) as stack:
        rollout_pids = pids(stack, "rollout-0", "rollout-1")
        # The job still runs when the fault arrives, however long the chaos command (a cold
        # process start) takes: it is ended only after the recovery.
        submit(stack, model_dir, "te", f"trainer.steps={LONG_STEPS}")
        eventually_sync(lambda: step_of(stack, "te") >= 4, timeout=180)
        [injected] = chaos(stack, "te", "--fault", "error", "--role", "trainer")
        assert (injected["fault"], injected["instance_id"]) == ("error", "trainer-0")
        incident = wait_for_incident(stack, "TRAINER_ERROR", "trainer-0", timeout=60)
        failed_at = injected["step"] - 1  # steps done when step `injected["step"]` failed
        assert f"stopped at step {failed_at} on an error: InjectedError" in incident["evidence"]
        steps = end_after_recoveries(stack, "te")
        finish(stack, "te")
        [rec] = recoveries(stack, "te")
        assert rec["kind"] == "TRAINER_ERROR"
        assert rec["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
        assert rec["replacements"][0].startswith("trainer-p")
        assert pids(stack, "rollout-0", "rollout-1") == rollout_pids
        # The fenced trainer lives on, off the job: the leader does not find it bound any more.
        fenced = member(stack, "trainer-0")
        assert fenced["job_id"] == "" and fenced["labels"].get("fenced") == "true", fenced
        assert_nothing_lost_or_trained_twice(stack, "te", tmp_path / "runs" / "te", steps_run=steps)

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


# The shared stack's tests, in the order they run on it. The NaN rollback and etcd's alarm leave
# every member as it was; the killed trainer and rollout are replaced by new processes, and the
# leader coordinator's kill only needs a trainer, rollouts and the other coordinator.


def test_a_nan_loss_is_rolled_back_without_replacing_anything(stack: Cli, model_dir: Path) -> None:
    submit(stack, model_dir, "tn", "faults.nan_loss_steps=[6]", f"trainer.steps={LONG_STEPS}")
    steps = end_after_recoveries(stack, "tn")
    finish(stack, "tn")
    [rec] = recoveries(stack, "tn")
    assert rec["kind"] == "NON_FINITE" and rec["actions"] == ["ROLLBACK trainer-0"]
    assert not rec["replacements"]
    assert [i["kind"] for i in incidents(stack, "tn")] == ["NON_FINITE"]
    assert_nothing_lost_or_trained_twice(stack, "tn", runs_of(stack) / "tn", steps)


def test_an_etcd_out_of_space_is_freed_by_the_leader_and_the_job_goes_on(
    stack: Cli, model_dir: Path
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

    logs = ride_out(stack, model_dir, "ns", nospace)
    coordinator_logs = logs.since_all("coordinator-*.log")
    assert "etcd.space_recovered" in coordinator_logs
    assert "trainer.failed" not in logs.since("trainer-0.log")


def test_a_trainer_and_a_rollout_killed_together_lose_no_group(stack: Cli, model_dir: Path) -> None:
    # As when one machine carries both: the groups the rollout delivered that the trainer had
    # not made durable are held by nobody. They must be generated again, not counted trained.
    victims = pids(stack, "trainer-0", "rollout-1")
    submit(stack, model_dir, "tr", f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(stack, "tr") >= 8, timeout=180)
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    wait_for_job_incident(stack, "tr", "MEMBER_LOST", "trainer-0", timeout=15)
    wait_for_job_incident(stack, "tr", "MEMBER_LOST", "rollout-1", timeout=15)
    steps = end_after_recoveries(stack, "tr", 2)
    finish(stack, "tr")
    recovered = {r["instance_id"]: r for r in recoveries(stack, "tr")}
    assert sorted(recovered) == ["rollout-1", "trainer-0"]
    # With no standby, the trainer's checkpoint is restored on a new one the provisioner starts.
    trainer = recovered["trainer-0"]
    assert trainer["actions"] == ["FENCE trainer-0", "RESTORE_TRAINER trainer-0"]
    assert trainer["replacements"][0].startswith("trainer-p")
    assert_nothing_lost_or_trained_twice(stack, "tr", runs_of(stack) / "tr", steps_run=steps)


def test_a_killed_leader_coordinator_restarts_no_data_plane_role(
    stack: Cli, model_dir: Path
) -> None:
    data_plane = data_plane_pids(stack)
    leader = next(m for m in stack.members() if m["leader"])
    submit(stack, model_dir, "lc", f"trainer.steps={LONG_STEPS}")
    eventually_sync(lambda: step_of(stack, "lc") >= 5, timeout=180)
    os.kill(int(str(leader["pid"])), signal.SIGKILL)

    def leaders() -> list[object]:
        return [m["instance_id"] for m in stack.members() if m["leader"]]

    def another_leads() -> bool:
        return any(name != leader["instance_id"] for name in leaders())

    # Another replica takes over (its election, once the killed one's lease lapsed) while the
    # job runs, and the job trains on under it.
    eventually_sync(
        another_leads,
        timeout=60,
        unmet=lambda: f"no replica but the killed {leader['instance_id']} leads: {leaders()}",
    )
    assert another_leads(), leaders()
    steps = end_after(stack, "lc", another_leads)
    finish(stack, "lc")
    after = data_plane_pids(stack)
    assert after == data_plane
    assert recoveries(stack, "lc") == []
    assert_nothing_lost_or_trained_twice(stack, "lc", runs_of(stack) / "lc", steps)
