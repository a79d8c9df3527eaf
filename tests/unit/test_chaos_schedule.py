"""`robustrl chaos`: the seeded plan, victim choice, and the trainer's side of INJECT_NAN."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from robustrl.cli import chaos as chaos_cli
from robustrl.cli.chaos import (
    Chaos,
    ChaosError,
    ChaosOptions,
    Injection,
    choose,
    control_target,
    engine_process,
    fault_choices,
    local_problem,
    plan_once,
    plan_schedule,
)
from robustrl.contracts.binding import Action, Binding, apply_control
from robustrl.contracts.errors import FailedPrecondition, Fenced, InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.members import ENGINE_PID_LABEL, MemberRecord
from robustrl.core.heartbeat import Progress
from robustrl.core.role_server import FAULT_STEP_KEY, RoleControl, fault_step
from robustrl.v1 import coordinator_pb2, trainer_pb2

# ----------------------------------------------------------------------------- the plan


def test_a_seed_gives_the_same_plan_and_another_seed_another() -> None:
    one = plan_schedule(200, 10, 7, ["random"], ["random"])
    assert one == plan_schedule(200, 10, 7, ["random"], ["random"])
    assert one != plan_schedule(200, 10, 8, ["random"], ["random"])


@pytest.mark.parametrize(("steps", "pct"), [(200, 10), (100, 25), (37, 12.5), (20, 10), (50, 30)])
def test_one_fault_per_pct_of_the_steps_strictly_inside_the_job(steps: int, pct: float) -> None:
    for seed in range(20):
        plan = plan_schedule(steps, pct, seed, ["kill", "hang"], ["trainer", "rollout"])
        assert len(plan) == int(100 // pct)
        width = steps * pct / 100
        for i, injection in enumerate(plan):
            assert 0 < injection.step < steps
            # Fault i lies in the i-th P% of the steps.
            assert i * width <= injection.step < (i + 1) * width
        assert [p.step for p in plan] == sorted(p.step for p in plan)


def test_the_steps_are_spread_by_the_seed_not_fixed() -> None:
    firsts = {plan_schedule(1000, 10, seed, ["kill"], ["rollout"])[0].step for seed in range(30)}
    assert len(firsts) > 10


def test_a_nan_or_an_error_is_planned_on_a_trainer_only() -> None:
    plan = plan_schedule(1000, 1, 3, ["random"], ["random"])
    assert {p.fault for p in plan} == {"kill", "hang", "nan", "error"}
    assert {p.role for p in plan if p.fault in ("nan", "error")} == {"trainer"}
    assert {p.role for p in plan} == {"trainer", "rollout"}
    # A rollout-only plan leaves NaN and error out rather than failing.
    assert {p.fault for p in plan_schedule(1000, 5, 3, ["random"], ["rollout"])} <= {"kill", "hang"}
    for fault in ("nan", "error"):
        with pytest.raises(ChaosError, match="only be injected into a trainer"):
            fault_choices([fault], ["rollout"])


def test_a_clean_stop_is_injected_only_when_named_and_into_any_role() -> None:
    """`random` keeps drawing among the four faults it always did, so a seed's plan (the demo's
    among them) does not change; `--fault stop` reaches trainers and rollouts alike."""
    assert {f for f, _ in fault_choices(["random"], ["random"])} == {"kill", "hang", "nan", "error"}
    assert sorted(fault_choices(["stop"], ["random"])) == [("stop", "rollout"), ("stop", "trainer")]
    plan = plan_schedule(1000, 5, 3, ["stop", "kill"], ["rollout"])
    assert {p.fault for p in plan} == {"stop", "kill"}


@pytest.mark.parametrize("pct", [0, -5, 101, float("nan"), float("inf")])
def test_a_bad_percentage_is_refused(pct: float) -> None:
    with pytest.raises(ChaosError, match="every-pct"):
        plan_schedule(100, pct, 0, ["kill"], ["rollout"])


def test_a_percentage_too_fine_for_the_job_is_refused_with_the_least_that_works() -> None:
    with pytest.raises(ChaosError, match="more than 20"):
        plan_schedule(5, 10, 0, ["kill"], ["rollout"])
    assert len(plan_schedule(5, 25, 0, ["kill"], ["rollout"])) == 4


def test_once_is_one_fault_now() -> None:
    once = plan_once(4, ["hang"], ["rollout"])
    assert (once.step, once.fault, once.role) == (0, "hang", "rollout")
    assert plan_once(4, ["random"], ["random"]) == plan_once(4, ["random"], ["random"])


def test_a_late_fault_keeps_to_its_window_or_is_skipped() -> None:
    first, second = plan_schedule(48, 50, 8, ["nan"], ["trainer"])
    assert (first.step, first.last, second.step, second.last) == (8, 23, 28, 47)
    assert control_target(first, job_step=3, taken=0) == 8
    assert control_target(first, job_step=20, taken=0) == 21  # late: the next step, in its half
    assert control_target(first, job_step=23, taken=0) is None  # step 24 is the next half's
    assert control_target(second, job_step=10, taken=27) == 28
    assert control_target(plan_once(1, ["nan"], ["trainer"]), job_step=99, taken=0) == 100


class FollowedJob(Chaos):
    """A schedule over a job that reads as `steps`, one per poll, then ends; its trainer takes
    each fault into the step it is asked for."""

    def __init__(self, steps: list[int], lines: list[str]) -> None:
        super().__init__(
            client=None,  # type: ignore[arg-type]  # every call that would use it is ours
            options=ChaosOptions("j", ["nan"], ["trainer"], every_pct=50, seed=8),
            say=lines.append,
        )
        self.steps = steps

    async def _read_job(self, request: coordinator_pb2.GetJobRequest) -> coordinator_pb2.Job:
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        phase = "RUNNING" if self.steps else "SUCCEEDED"
        return coordinator_pb2.Job(
            job_id="j",
            step=step,
            phase=coordinator_pb2.JobPhase.Value(f"JOB_PHASE_{phase}"),
            spec_json=json.dumps({"trainer": {"steps": 48}}),
        )

    async def _members(self) -> list[MemberRecord]:
        return [member("trainer-0", "trainer")]

    async def _send(self, address: str, request: trainer_pb2.ControlRequest) -> int:
        return int(request.args["step"])


async def test_a_schedule_that_first_sees_the_job_late_skips_the_missed_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chaos_cli, "POLL_S", 0.0)
    lines: list[str] = []
    # Seen first at step 23, the last of the first half: its fault (planned for step 8) would
    # land in step 24, the second half's. It is skipped, and the second half still gets its own.
    injected = await FollowedJob([0, 23, 26, 30, 48], lines).run()
    assert [(i.fault, i.step) for i in injected] == [("nan", 28)]
    assert any("step 8: nan missed its window" in line for line in lines), lines
    on_time = await FollowedJob([0, 6, 26, 48], []).run()
    assert [i.step for i in on_time] == [8, 28]


def member(instance_id: str, role: str = "rollout", **extra: Any) -> MemberRecord:
    return MemberRecord(
        role=role, instance_id=instance_id, address="x:1", pid=1, host="h", job_id="j", **extra
    )


def test_the_victim_is_chosen_by_the_plan_among_the_role_in_instance_order() -> None:
    members = [member("rollout-1"), member("trainer-0", "trainer"), member("rollout-0")]
    picks = [choose(members, Injection(1, "kill", "rollout", pick)) for pick in range(4)]
    assert [m.instance_id for m in picks if m] == ["rollout-0", "rollout-1"] * 2
    assert choose(list(reversed(members)), Injection(1, "kill", "rollout", 3)) == choose(
        members, Injection(1, "kill", "rollout", 3)
    )
    follower = member("trainer-0-rank1", "trainer", labels={"follower": "true"})
    assert choose([follower], Injection(1, "nan", "trainer", 0)) is None  # no Control there
    assert choose([follower], Injection(1, "kill", "trainer", 0)) == follower


def test_only_python_processes_on_this_host_are_signalled() -> None:
    here = socket.gethostname()
    me = MemberRecord(
        role="rollout", instance_id="r", address="x:1", pid=os.getpid(), host=here, job_id="j"
    )
    assert "not on this host" in str(local_problem(me.model_copy(update={"host": "elsewhere"})))
    assert "this command" in str(local_problem(me))  # a python process, but us
    parent = me.model_copy(update={"pid": os.getppid()})
    cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    assert (local_problem(parent) is None) == (b"python" in cmdline.split(b"\0")[0])
    assert "no process" in str(local_problem(me.model_copy(update={"pid": 2**22 + 1})))


def test_an_engine_is_signalled_alone_only_when_its_label_names_a_child_of_the_member() -> None:
    # A stand-in rollout (python) with a child of its own, as vLLM's engine core is.
    script = (
        "import signal, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
        "print(child.pid, flush=True)\n"
        "signal.pause()\n"
    )
    rollout = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine = 0
    try:
        assert rollout.stdout is not None
        engine = int(rollout.stdout.readline())
        me = MemberRecord(
            role="rollout",
            instance_id="r",
            address="x:1",
            pid=rollout.pid,
            host=socket.gethostname(),
            job_id="j",
        )
        labelled = me.changed({ENGINE_PID_LABEL: str(engine)})
        assert engine_process(labelled) == (engine, None)
        assert "rollout.engine: torch" in str(engine_process(me)[1])  # no label: in-process
        mislabelled = me.changed({ENGINE_PID_LABEL: str(rollout.pid)})  # its own pid
        assert "not its engine process" in str(engine_process(mislabelled)[1])
        elsewhere = labelled.model_copy(update={"host": "elsewhere"})
        assert "not on this host" in str(engine_process(elsewhere)[1])
    finally:
        if engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
        rollout.kill()
        rollout.wait()


# ----------------------------------------------------------------------------- INJECT_NAN


def test_inject_nan_leaves_the_binding_alone_and_is_refused_like_everything_else() -> None:
    bound = Binding(job_id="j", epoch=2)
    assert apply_control(bound, Action.ACTION_INJECT_NAN, "j", 2) == bound
    assert apply_control(bound, Action.ACTION_INJECT_NAN, "j", 5) == bound  # epoch unchanged
    with pytest.raises(FailedPrecondition, match="older"):
        apply_control(bound, Action.ACTION_INJECT_NAN, "j", 1)
    with pytest.raises(FailedPrecondition, match="not bound"):
        apply_control(Binding(), Action.ACTION_INJECT_NAN, "j", 0)
    with pytest.raises(FailedPrecondition, match="not other"):
        apply_control(bound, Action.ACTION_INJECT_NAN, "other", 2)
    with pytest.raises(Fenced):
        apply_control(Binding(job_id="j", epoch=2, fenced=True), Action.ACTION_INJECT_NAN, "j", 3)


def test_the_fault_step_is_the_next_one_not_yet_taken() -> None:
    assert fault_step(4, "waiting_data", 10, None) == 5
    assert fault_step(4, "publish", 10, "") == 5
    assert fault_step(4, "forward_backward", 10, None) == 6  # step 5's batch is in already
    assert fault_step(4, "waiting_data", 10, "9") == 9
    with pytest.raises(InvalidArgument, match="earliest step a fault can go into is 6"):
        fault_step(4, "collective", 10, "5")
    with pytest.raises(InvalidArgument, match="step number"):
        fault_step(4, "waiting_data", 10, "five")
    with pytest.raises(InvalidArgument, match="past the job's last step 10"):
        fault_step(4, "waiting_data", 10, "11")
    with pytest.raises(InvalidArgument, match="past the job's last step"):
        fault_step(10, "waiting_data", 10, None)


class FakeTrainerWorker:
    job_id = "j"
    epoch = 0

    def __init__(self, step: int) -> None:
        self.step = step
        self.spec = JobSpec(name="j")
        self.nan_steps: set[int] = set()
        self.error_steps: set[int] = set()

    def inject_nan(self, step: int) -> None:
        self.nan_steps.add(step)

    def inject_error(self, step: int) -> None:
        self.error_steps.add(step)

    def prepare(self) -> None: ...

    def load(self) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


def role_control(role: str) -> RoleControl:
    runtime: Any = SimpleNamespace(
        role=role, instance_id=f"{role}-0", settings=SimpleNamespace(epoch=1), progress=Progress()
    )
    control = RoleControl(runtime, make_worker=lambda *_: FakeTrainerWorker(0))
    control.binding = Binding(job_id="j", epoch=1)
    return control


def nan_request(**args: str) -> trainer_pb2.ControlRequest:
    return trainer_pb2.ControlRequest(
        action=trainer_pb2.ControlRequest.ACTION_INJECT_NAN, job_id="j", epoch=1, args=args
    )


def error_request(**args: str) -> trainer_pb2.ControlRequest:
    return trainer_pb2.ControlRequest(
        action=trainer_pb2.ControlRequest.ACTION_INJECT_ERROR, job_id="j", epoch=1, args=args
    )


async def test_a_bound_trainer_poisons_the_step_and_names_it() -> None:
    control = role_control("trainer")
    worker = FakeTrainerWorker(step=3)
    control.worker = worker
    reply = await control.Control(nan_request(), context=None)
    assert worker.nan_steps == {4}
    assert reply.status.metrics[FAULT_STEP_KEY] == 4
    reply = await control.Control(nan_request(step="7"), context=None)
    assert worker.nan_steps == {4, 7} and control.binding == Binding(job_id="j", epoch=1)


async def test_a_bound_trainer_takes_an_error_for_a_step_and_names_it() -> None:
    control = role_control("trainer")
    worker = FakeTrainerWorker(step=3)
    control.worker = worker
    control.runtime.progress.phase = "forward_backward"  # step 4's batch is in: step 5 then
    reply = await control.Control(error_request(), context=None)
    assert worker.error_steps == {5} and not worker.nan_steps
    assert reply.status.metrics[FAULT_STEP_KEY] == 5
    with pytest.raises(InvalidArgument, match="earliest step a fault can go into is 5"):
        await control.Control(error_request(step="4"), context=None)
    assert worker.error_steps == {5} and control.binding == Binding(job_id="j", epoch=1)
    with pytest.raises(FailedPrecondition, match="only a bound trainer takes INJECT_ERROR"):
        await role_control("trainer").Control(error_request(), context=None)


def test_inject_error_is_checked_like_inject_nan() -> None:
    bound = Binding(job_id="j", epoch=2)
    assert apply_control(bound, Action.ACTION_INJECT_ERROR, "j", 2) == bound
    with pytest.raises(FailedPrecondition, match="not bound"):
        apply_control(Binding(), Action.ACTION_INJECT_ERROR, "j", 0)
    with pytest.raises(Fenced):
        apply_control(Binding(job_id="j", epoch=2, fenced=True), Action.ACTION_INJECT_ERROR, "j", 3)


async def test_inject_nan_without_a_trainer_worker_is_a_failed_precondition() -> None:
    idle_trainer = role_control("trainer")
    with pytest.raises(FailedPrecondition, match="only a bound trainer"):
        await idle_trainer.Control(nan_request(), context=None)
    rollout = role_control("rollout")
    rollout.worker = FakeTrainerWorker(step=3)
    with pytest.raises(FailedPrecondition, match="rollout"):
        await rollout.Control(nan_request(), context=None)
