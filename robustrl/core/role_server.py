"""Status and control shared by the data-plane roles (trainer, rollout).

BIND carries the job's spec; the role builds a worker for it (loading the model in a thread)
and only then accepts the binding, so a bad spec or a missing model is refused with a clear
error instead of failing later. RELEASE and FENCE stop the worker. INJECT_NAN (chaos) asks a
trainer's worker to make one step's loss non-finite; INJECT_ERROR, to stop with an error at one
step.

BIND may carry args["rank"]: a trainer's rank in its job's group (`trainer.world_size` > 1).
The member labels itself rank=<r> and follower=true for r > 0 while bound (rollouts stream to
rank 0 only), and drops both labels when it leaves the job.

RELEASE or FENCE with args["exit"] == "true" also ends the process once it has answered, as
SIGTERM would (the full-restart baseline restarts every role as a new process).

PREPARE (sent to free warm standbys) builds the worker's job-independent part ahead, the model
above all, and keeps it; a BIND of the same job and spec then takes it and only finishes the
load (a trainer restores the latest checkpoint). A worker that keeps warm (a rollout: it pulls
each new weight version while it waits) starts doing so once built. The instance stays free
meanwhile and labels its registry record prepared=<job>, so the leader knows whom it prepared.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import grpc
import pydantic

from robustrl.contracts.binding import Binding, apply_control
from robustrl.contracts.errors import FailedPrecondition, InvalidArgument, describe_validation_error
from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.members import RANK_LABEL
from robustrl.contracts.roles import ROLE_TO_PROTO
from robustrl.core.config import MemberSettings
from robustrl.core.logs import get_logger
from robustrl.core.processes import set_niceness
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import trainer_pb2

log = get_logger(__name__)

Action = trainer_pb2.ControlRequest


class Worker(Protocol):
    job_id: str
    epoch: int
    spec: JobSpec

    def prepare(self) -> None:
        """Blocking set-up that does not depend on the job's progress (model, reward
        plug-in); raises InvalidArgument on bad input. A second call does nothing."""

    def load(self) -> None:
        """`prepare` if not done, then what depends on the job's progress (a checkpoint)."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


WorkerFactory = Callable[[str, int, JobSpec], Worker]


@runtime_checkable
class FaultTarget(Protocol):
    """A worker that chaos can make fail at a step: the trainer's."""

    step: int
    """Steps done so far."""

    spec: JobSpec

    def inject_nan(self, step: int) -> None: ...

    def inject_error(self, step: int) -> None: ...


@runtime_checkable
class Ranked(Protocol):
    """A worker with a rank in its job's group (the trainer's), set at BIND before `load`."""

    rank: int


RANK_ARG = "rank"
"""BIND's args[RANK_ARG]: the bound trainer's rank in its group (default 0)."""

FOLLOWER_LABEL = "follower"
"""With RANK_LABEL, the registry labels of a trainer bound as rank r > 0: rank=<r>,
follower=true."""


def rank_labels(rank: int) -> dict[str, str | None]:
    """The labels a member bound at `rank` carries (None: removed)."""
    if rank == 0:
        return {RANK_LABEL: None, FOLLOWER_LABEL: None}
    return {RANK_LABEL: str(rank), FOLLOWER_LABEL: "true"}


def rank_from_args(args: dict[str, str]) -> int:
    raw = args.get(RANK_ARG, "0")
    if not raw.isdigit():
        raise InvalidArgument(f"args['rank'] must be a rank (0, 1, ...), not {raw!r}")
    return int(raw)


@runtime_checkable
class KeepsWarm(Protocol):
    """A worker that, once prepared, keeps up with the job while it waits to be bound (a
    standby rollout pulls each new weight version); its `start` and `stop` end that."""

    def keep_warm(self) -> None: ...


STEP_PHASES = frozenset({"forward_backward", "optimizer", "collective"})
"""Trainer phases inside a step: step `worker.step + 1` has its batch (and any NaN) already."""

PREPARED_LABEL = "prepared"
"""Registry label of a free standby that holds a prepared worker: the job it prepared for."""

EXIT_ARG = "exit"
"""RELEASE or FENCE with args[EXIT_ARG] == "true" also ends the process (full restart)."""

LEAVING_LABEL = "leaving"
"""Registry label of a member that is about to exit: never bound."""

FAULT_STEP_KEY = "fault_step"
"""INJECT_NAN and INJECT_ERROR ask for a step in args["step"]; the reply's
status.metrics[FAULT_STEP_KEY] names the step taken (the caller may leave the choice to the
trainer)."""

INJECTED_FAULTS = {Action.ACTION_INJECT_NAN: "nan", Action.ACTION_INJECT_ERROR: "error"}
"""The chaos actions and the fault each injects."""


def fault_step(worker_step: int, phase: str, last_step: int, asked: str | None) -> int:
    """The step a chaos fault goes into: `asked`, or the next one whose batch is not taken
    yet."""
    earliest = worker_step + (2 if phase in STEP_PHASES else 1)
    if asked is None or asked == "":
        step = earliest
    else:
        try:
            step = int(asked)
        except ValueError:
            raise InvalidArgument(f"args['step'] must be a step number, not {asked!r}") from None
        if step < earliest:
            raise InvalidArgument(
                f"step {step} has started or is done (the trainer has done {worker_step}); "
                f"the earliest step a fault can go into is {earliest}"
            )
    if step > last_step:
        raise InvalidArgument(f"step {step} is past the job's last step {last_step}")
    return step


def spec_from_args(args: dict[str, str]) -> JobSpec:
    if "spec_json" not in args:
        raise InvalidArgument("BIND needs the job spec in args['spec_json']")
    try:
        return JobSpec.model_validate_json(args["spec_json"])
    except pydantic.ValidationError as exc:
        raise InvalidArgument(
            "the job spec does not validate: " + describe_validation_error(exc)
        ) from exc


@dataclass(frozen=True)
class Prepared:
    """A worker PREPARE is building or has built."""

    job_id: str
    spec: JobSpec
    task: asyncio.Task[Worker]

    def serves(self, job_id: str, spec: JobSpec) -> bool:
        """For this job and spec, and not failed (a failed build is tried again). The step
        budget aside: `robustrl update` changes it while the job runs, and nothing a worker
        builds ahead depends on it."""
        failed = self.task.done() and (self.task.cancelled() or self.task.exception() is not None)
        same = (self.job_id, budgetless(self.spec)) == (job_id, budgetless(spec))
        return same and not failed


def budgetless(spec: JobSpec) -> JobSpec:
    """`spec` with its step budget set aside (`steps`; what the job was planned for stays)."""
    planned = spec.trainer.planned_steps
    trainer = spec.trainer.model_copy(update={"steps": planned, "lr_decay_steps": planned})
    return spec.model_copy(update={"trainer": trainer})


class RoleControl:
    """GetStatus / Control handlers, mixed into the servicers of both roles."""

    def __init__(self, runtime: ServiceRuntime, make_worker: WorkerFactory) -> None:
        self.runtime = runtime
        self.make_worker = make_worker
        self.binding = Binding(epoch=runtime.settings.epoch)
        self.worker: Worker | None = None
        self.prepared: Prepared | None = None
        self._fencing: asyncio.Task[None] | None = None
        self._discarding: set[asyncio.Task[None]] = set()
        self._niceness_when_bound: int | None = None
        """Set while a standby runs nicer than it started (MemberSettings.standby_nice)."""
        settings = runtime.settings
        if isinstance(settings, MemberSettings) and settings.standby and settings.standby_nice:
            self._niceness_when_bound = os.nice(0)
            set_niceness(os.getpid(), min(19, self._niceness_when_bound + settings.standby_nice))

    def status(self) -> trainer_pb2.RoleStatus:
        progress = self.runtime.progress
        status = trainer_pb2.RoleStatus(
            role=ROLE_TO_PROTO[self.runtime.role],
            instance_id=self.runtime.instance_id,
            epoch=self.binding.epoch,
            job_id=self.binding.job_id,
            phase="fenced" if self.binding.fenced else progress.phase,
            step=int(progress.counters.get("step", 0)),
            weight_version=int(progress.counters.get("weight_version", 0)),
        )
        status.metrics.update(progress.counters)
        return status

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.RoleStatus:
        return self.status()

    async def Control(
        self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ControlResponse:
        before = self.binding
        after = apply_control(before, request.action, request.job_id, request.epoch)
        if request.action in INJECTED_FAULTS:
            return self.inject(INJECTED_FAULTS[request.action], request.args.get("step"))
        if request.action == Action.ACTION_PREPARE:
            await self.prepare(request.job_id, spec_from_args(dict(request.args)))
            return trainer_pb2.ControlResponse(status=self.status())
        if request.action == Action.ACTION_FENCE:
            self.fenced(after)  # apply_control refused it if fenced already: it starts here
            assert self._fencing is not None
            await self._fencing
            if request.args.get(EXIT_ARG) == "true":
                await self._exit_soon()
            return trainer_pb2.ControlResponse(status=self.status())
        worker: Worker | None = None
        labels: dict[str, str | None] | None = None
        if request.action == Action.ACTION_BIND:
            if self.worker is not None:
                raise FailedPrecondition(f"already working on job {self.worker.job_id}")
            spec = spec_from_args(dict(request.args))
            rank = rank_from_args(dict(request.args))
            self._stop_yielding()
            worker = await self._take_prepared(request.job_id, spec)
            if worker is None:
                worker = self.make_worker(request.job_id, request.epoch, spec)
            worker.spec = spec  # a prepared one has the budget of its PREPARE (`serves`)
            worker.epoch = request.epoch
            if isinstance(worker, Ranked):
                worker.rank = rank
            elif rank:
                raise InvalidArgument(f"a {self.runtime.role} has no rank; BIND it at rank 0")
            labels = rank_labels(rank)
            try:
                await asyncio.to_thread(worker.load)
            except BaseException:
                await worker.stop()  # what it started (an engine's processes) goes with it
                raise
        self.binding = after
        if after != before:
            self._report(after)
            try:
                if not after.job_id:
                    labels = rank_labels(0)
                await self.runtime.update_member(
                    job_id=after.job_id, epoch=after.epoch, labels=labels
                )
            except BaseException:
                # Not in the registry (etcd refused it): not bound here either, or this
                # instance would refuse every other job while the leader takes it for free.
                if self.binding is after:  # no other control changed it meanwhile
                    self.binding = before
                    self._report(before)
                raise
            log.info(
                f"{self.runtime.role}.control",
                action=trainer_pb2.ControlRequest.Action.Name(request.action),
                job=after.job_id,
                epoch=after.epoch,
            )
        if worker is not None:
            self.worker = worker
            self.runtime.progress.phase = "working"
            worker.start()
        elif request.action == Action.ACTION_RELEASE:
            await self.stop_worker()
            if request.args.get(EXIT_ARG) == "true":
                await self._exit_soon()
        return trainer_pb2.ControlResponse(status=self.status())

    def _stop_yielding(self) -> None:
        """A standby being bound: back to its start niceness, with whatever it started (an
        engine's processes), before it loads and works for its job."""
        if self._niceness_when_bound is None:
            return
        threads = set_niceness(os.getpid(), self._niceness_when_bound)
        log.info(
            f"{self.runtime.role}.priority_restored",
            niceness=self._niceness_when_bound,
            threads=threads,
        )
        self._niceness_when_bound = None

    async def prepare(self, job_id: str, spec: JobSpec) -> None:
        """Build `job_id`'s worker ahead of a BIND (see the module doc); idempotent."""
        if self.worker is not None:
            raise FailedPrecondition(f"already working on job {self.worker.job_id}")
        prepared = self.prepared
        if prepared is None or not prepared.serves(job_id, spec):
            if prepared is not None:
                self._discard(prepared)
            task = asyncio.get_running_loop().create_task(
                self._build(job_id, spec), name=f"prepare-{job_id}"
            )
            self.prepared = prepared = Prepared(job_id, spec, task)
        await asyncio.shield(prepared.task)  # a bad spec is the caller's error
        labelled = self._label(PREPARED_LABEL) == job_id
        if self.prepared is prepared and self.worker is None and not labelled:
            await self._relabel({PREPARED_LABEL: job_id})
            log.info(f"{self.runtime.role}.prepared", job=job_id)

    async def _build(self, job_id: str, spec: JobSpec) -> Worker:
        worker = self.make_worker(job_id, self.binding.epoch, spec)
        await asyncio.to_thread(worker.prepare)
        if isinstance(worker, KeepsWarm):
            worker.keep_warm()
        return worker

    async def _take_prepared(self, job_id: str, spec: JobSpec) -> Worker | None:
        """The prepared worker, if it was prepared for this job and spec (waiting for it if it
        is still being built); None otherwise. Either way nothing stays prepared."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        if self._label(PREPARED_LABEL) is not None:
            await self._relabel({PREPARED_LABEL: None})
        if not prepared.serves(job_id, spec):
            self._discard(prepared)
            return None
        try:
            worker = await prepared.task
        except Exception as exc:  # the BIND loads afresh and reports its own error
            log.info(f"{self.runtime.role}.prepared_unusable", job=job_id, error=repr(exc))
            return None
        log.info(f"{self.runtime.role}.took_prepared", job=job_id)
        return worker

    async def _exit_soon(self) -> None:
        """RELEASE/FENCE with args["exit"]: this process stops, as on SIGTERM (goodbye, then
        deregistration), right after the reply. Labelled leaving=true first, so that nobody
        binds it in the moment it still looks free."""
        await self._relabel({LEAVING_LABEL: "true"})
        log.warning(f"{self.runtime.role}.exiting", reason="asked to restart as a new process")
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)

    def _label(self, name: str) -> str | None:
        assert self.runtime.member is not None
        return self.runtime.member.labels.get(name)

    async def _relabel(self, labels: dict[str, str | None], **changes: object) -> None:
        """Rewrite this member's registry record with `labels` set (None: removed), and any
        other field in `changes` (job_id)."""
        await self.runtime.update_member(labels=labels, **changes)

    def inject(self, fault: str, asked: str | None) -> trainer_pb2.ControlResponse:
        """INJECT_NAN or INJECT_ERROR (`fault`: nan or error) into a step of a bound trainer."""
        worker = self.worker
        if isinstance(worker, Ranked) and worker.rank > 0:
            raise FailedPrecondition(
                f"{self.runtime.instance_id} is rank {worker.rank} of its group, which runs no "
                f"step loop; INJECT_{fault.upper()} goes to rank 0"
            )
        if self.runtime.role != "trainer" or not isinstance(worker, FaultTarget):
            raise FailedPrecondition(
                f"{self.runtime.instance_id} is a {self.runtime.role} without a running trainer "
                f"step loop; only a bound trainer takes INJECT_{fault.upper()}"
            )
        phase = self.runtime.progress.phase
        step = fault_step(worker.step, phase, worker.spec.trainer.steps, asked)
        (worker.inject_nan if fault == "nan" else worker.inject_error)(step)
        log.warning(f"trainer.chaos_{fault}", job=self.binding.job_id, step=step)
        status = self.status()
        status.metrics[FAULT_STEP_KEY] = float(step)
        return trainer_pb2.ControlResponse(status=status)

    def _report(self, binding: Binding) -> None:
        """Beat the binding's job and epoch, at once: the monitor answers `fenced` only to a
        beat at or below the epoch a fence names, and a member that fails right after its BIND
        (a poison prompt in its first batch) must be reported with the job it was bound to,
        not as a free member, whose loss recovers nothing."""
        self.runtime.progress.job_id = binding.job_id
        self.runtime.progress.epoch = binding.epoch
        self.runtime.progress.urge()

    def fenced(self, binding: Binding | None = None) -> None:
        """This instance was fenced (it was replaced): leave the job in the registry, stop
        working and accept nothing more. Told by the monitor's beat (while it was away), or by
        the leader's Control FENCE, which passes the binding it makes."""
        if self.binding.fenced:
            return
        log.warning(f"{self.runtime.role}.fenced", job=self.binding.job_id)
        self.binding = binding or replace(self.binding, fenced=True)
        self._fencing = asyncio.get_running_loop().create_task(self._stop_fenced())

    async def _stop_fenced(self) -> None:
        # Off the job in the registry first: it no longer serves it, whatever it believed, and
        # the leader must not wait on it while its work unwinds (which a frozen peer can stall).
        self.runtime.progress.job_id = ""
        await self._relabel({"fenced": "true", **rank_labels(0)}, job_id="")
        log.info(f"{self.runtime.role}.left_job", job=self.binding.job_id)
        await self.stop_worker()
        if self.runtime.settings.exit_when_fenced:
            log.warning(f"{self.runtime.role}.exiting_fenced", job=self.binding.job_id)
            self.runtime.ask_to_stop()

    async def stop_worker(self) -> None:
        """Stop the bound worker, and any prepared one: both may hold processes (an engine's)."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            await worker.stop()
            self.runtime.progress.phase = "idle"
        if self.prepared is not None:
            prepared, self.prepared = self.prepared, None
            self._discard(prepared)
        if self._discarding:
            await asyncio.gather(*self._discarding, return_exceptions=True)

    def _discard(self, prepared: Prepared) -> None:
        """A prepared worker nobody will take: stopped once it is built (a thread that builds
        cannot be cancelled, and what it builds may own processes)."""
        task = asyncio.get_running_loop().create_task(
            _stop_when_built(prepared.task), name=f"discard-{prepared.job_id}"
        )
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)


async def _stop_when_built(build: asyncio.Task[Worker]) -> None:
    try:
        worker = await build
    except (Exception, asyncio.CancelledError):
        return  # nothing was built
    await worker.stop()
