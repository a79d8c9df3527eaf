"""`robustrl chaos JOB`: inject failures into a running job — kill, hang, NaN, error, stop.

- kill: SIGKILL of the member's process; hang: SIGSTOP (with `--hang-for S`, SIGCONT after S
  seconds: a zombie that comes back, which recovery must survive); nan: the trainer's Control
  INJECT_NAN, so one step's loss is non-finite; error: the trainer's Control INJECT_ERROR, so it
  stops with an error at one step, as a failing device would; stop: SIGTERM, a clean stop of a
  member that still serves the job (a pod deleted, a node drained). `stop` is only injected when
  named (`--fault stop`): `random` draws among the other four, so a seed plans what it always did.
- `--engine`: kill or hang the rollout's inference engine alone (vLLM's engine core, the process
  its `engine_pid` label names) while the rollout service lives on and keeps beating.
- Signals go only to processes on this host: the member's host is this machine's hostname and
  its pid runs python. A NaN or an error goes over gRPC, wherever the trainer runs.
- `--once` (the default) injects one fault now. `--every-pct P --seed S` plans one fault per
  P% of the job's `trainer.steps`, at steps drawn from the seed (`plan_schedule`, pure), then
  follows the job's step and injects each when its step comes. It ends when the job ends or
  the plan is done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import grpc

from robustrl.cli.chaos_processes import engine_process, local_problem, start_time
from robustrl.contracts.members import ENGINE_PID_LABEL, MemberRecord
from robustrl.contracts.roles import DATA_PLANE_ROLES as ROLES
from robustrl.core.channels import DEFAULT_DEADLINE, open_channel
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.role_server import FAULT_STEP_KEY
from robustrl.v1 import coordinator_pb2, trainer_pb2, trainer_pb2_grpc

RANDOM_FAULTS = ("kill", "hang", "nan", "error")
"""What `random` (or no --fault) draws from."""
FAULTS = (*RANDOM_FAULTS, "stop")
SIGNAL_FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGTERM}
"""Faults that are one signal to the member's process (a hang is SIGSTOP, then maybe SIGCONT)."""
ENGINE_FAULTS = ("kill", "hang")
"""Faults `--engine` can send to an engine process."""
CONTROL_FAULTS = {
    "nan": trainer_pb2.ControlRequest.ACTION_INJECT_NAN,
    "error": trainer_pb2.ControlRequest.ACTION_INJECT_ERROR,
}
"""Faults sent to a trainer over gRPC (Control), for a step of its choosing or ours."""
POLL_S = 0.2
"""How often a scheduled run reads the job's step."""

CONTROL_LEAD = 2
"""A planned NaN or error for step s is sent once the job reports step s - 2: the trainer cannot
have taken step s's batch before it reports s - 1, so step s is still ahead. Sent later (a slow
poll), it goes into step s if the trainer has not taken that batch yet, else the next one."""

_LIVE = (coordinator_pb2.JOB_PHASE_RUNNING, coordinator_pb2.JOB_PHASE_RECOVERING)


class ChaosError(Exception):
    """Input chaos refuses before it injects anything (exit 2)."""


@dataclass(frozen=True)
class Injection:
    """One planned fault. `pick` chooses among the role's members when it is injected
    (sorted by instance id), so a seed gives the same victims on the same membership."""

    step: int
    """The step it waits for (0: at once)."""
    fault: str
    role: str
    pick: int
    last: int | None = None
    """The last step of its window (a schedule's): a fault not injected by then is skipped,
    never pushed into the next window. None: no bound (`--once`)."""


@dataclass(frozen=True)
class Injected:
    """What was done: the --json output, one per injection."""

    at: float
    step: int
    fault: str
    role: str
    instance_id: str
    pid: int
    process: str = "member"
    """Whose process `pid` is: the member's, or its engine's (`--engine`)."""


# ----------------------------------------------------------------------------- the plan (pure)


def fault_choices(faults: Sequence[str], roles: Sequence[str]) -> list[tuple[str, str]]:
    """Every (fault, role) pair the options allow: a NaN or an error goes to a trainer only."""
    faults = (
        list(RANDOM_FAULTS) if not faults or "random" in faults else list(dict.fromkeys(faults))
    )
    roles = list(ROLES) if not roles or "random" in roles else list(dict.fromkeys(roles))
    unknown = [f for f in faults if f not in FAULTS] + [r for r in roles if r not in ROLES]
    if unknown:
        raise ChaosError(f"unknown fault or role: {', '.join(unknown)}")
    pairs = [(f, r) for f in faults for r in roles if f not in CONTROL_FAULTS or r == "trainer"]
    if not pairs:
        raise ChaosError("a NaN or an error can only be injected into a trainer (--role trainer)")
    return pairs


def _draw(
    rng: random.Random, pairs: list[tuple[str, str]], step: int, last: int | None = None
) -> Injection:
    fault, role = rng.choice(pairs)
    return Injection(step=step, fault=fault, role=role, pick=rng.randrange(1 << 30), last=last)


def plan_once(seed: int, faults: Sequence[str], roles: Sequence[str]) -> Injection:
    """One fault, now."""
    return _draw(random.Random(seed), fault_choices(faults, roles), 0)


def plan_schedule(
    steps: int, every_pct: float, seed: int, faults: Sequence[str], roles: Sequence[str]
) -> list[Injection]:
    """One fault per `every_pct`% of `steps`: window i is steps [i*w, (i+1)*w) with
    w = steps * every_pct / 100, and its fault lands on a step drawn from the seed, inside
    (0, steps) — never before the first step nor on the last (there is nothing after it to
    recover into). A fault sent late still lands in its own window, or is skipped (`missed`).
    Deterministic for a seed."""
    if not math.isfinite(every_pct) or not 0 < every_pct <= 100:
        raise ChaosError(f"--every-pct must be a percentage in (0, 100], not {every_pct}")
    pct = Fraction(str(every_pct))
    width = steps * pct / 100
    if width <= 1:
        least = Fraction(100, max(steps, 1))
        raise ChaosError(
            f"--every-pct {every_pct} of {steps} steps leaves windows of {float(width):.2g} "
            f"steps; each needs a step of its own: use more than {float(least):.3g}"
        )
    pairs = fault_choices(faults, roles)
    rng = random.Random(seed)
    plan: list[Injection] = []
    for i in range(math.floor(100 / pct)):
        lo = max(1, math.ceil(i * width))
        hi = min(steps - 1, math.ceil((i + 1) * width) - 1)
        plan.append(_draw(rng, pairs, rng.randint(lo, hi), last=hi))
    return plan


def choose(members: Sequence[MemberRecord], injection: Injection) -> MemberRecord | None:
    """The victim among the job's members of the injection's role."""
    candidates = sorted(
        (m for m in members if m.role == injection.role and can_take(m, injection.fault)),
        key=lambda m: m.instance_id,
    )
    return candidates[injection.pick % len(candidates)] if candidates else None


def lead(fault: str) -> int:
    """How many steps ahead of its step a planned fault is sent (Control faults: CONTROL_LEAD)."""
    return CONTROL_LEAD if fault in CONTROL_FAULTS else 0


def can_take(member: MemberRecord, fault: str, engine: bool = False) -> bool:
    """A NaN or an error goes through Control, which trainer follower ranks do not serve; with
    `engine`, only a member whose engine runs in a process of its own can take it."""
    if engine:
        return ENGINE_PID_LABEL in member.labels
    return fault not in CONTROL_FAULTS or member.labels.get("follower") != "true"


def missed(injection: Injection, next_step: int) -> bool:
    """Whether the earliest step a fault could still take lies past its window's end."""
    return injection.last is not None and next_step > injection.last


def control_target(injection: Injection, job_step: int, taken: int) -> int | None:
    """The step a NaN or an error is asked for: its own, or the job's next if that is later,
    and after `taken` (the last step an earlier one of the run took). None past its window."""
    target = max(injection.step, job_step + 1, taken + 1)
    return None if missed(injection, target) else target


def phase_name(job: coordinator_pb2.Job) -> str:
    return coordinator_pb2.JobPhase.Name(job.phase).removeprefix("JOB_PHASE_")


@dataclass
class ChaosOptions:
    job: str
    faults: list[str]
    roles: list[str]
    instance: str = ""
    every_pct: float | None = None
    seed: int = 0
    hang_for: float | None = None
    engine: bool = False


class Chaos:
    def __init__(
        self, client: CoordinatorClient, options: ChaosOptions, say: Callable[[str], None]
    ) -> None:
        self.client = client
        self.options = options
        self.say = say
        self.injected: list[Injected] = []
        self._resumes: list[asyncio.Task[None]] = []
        self._stopped: dict[int, str | None] = {}
        """pid -> start time of each process we stopped and have not resumed."""

    async def run(self) -> list[Injected]:
        """Validate, plan, inject; resumes every process it stopped before it returns."""
        try:
            job = await self._job()
            members = await self._members()
            roles, faults = self._targets(members)
            if self.options.every_pct is None:
                await self._inject(plan_once(self.options.seed, faults, roles), job, members)
            else:
                steps = int(json.loads(job.spec_json or "{}").get("trainer", {}).get("steps", 0))
                plan = plan_schedule(
                    steps, self.options.every_pct, self.options.seed, faults, roles
                )
                self.say(
                    f"plan (seed {self.options.seed}, one fault per {self.options.every_pct:g}% "
                    f"of {steps} steps): "
                    + ", ".join(f"step {p.step} {p.fault} {p.role}" for p in plan)
                )
                await self._follow(plan)
            if self._resumes:
                await asyncio.gather(*self._resumes)
        finally:
            for task in self._resumes:
                task.cancel()
            self._resume_all()
        return self.injected

    async def _job(self) -> coordinator_pb2.Job:
        """The job, running. A schedule waits for a PENDING job to start; `--once` does not."""
        request = coordinator_pb2.GetJobRequest(job_id=self.options.job)
        waiting = False
        while True:
            try:
                job = await self._read_job(request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise ChaosError(f"no job {self.options.job}") from exc
                raise
            if job.phase in _LIVE:
                return job
            phase = phase_name(job)
            if job.phase != coordinator_pb2.JOB_PHASE_PENDING or self.options.every_pct is None:
                raise ChaosError(
                    f"job {job.job_id} is {phase}, not running; nothing to inject into"
                )
            if not waiting:
                self.say(f"job {job.job_id} is {phase}; waiting for it to run")
                waiting = True
            await asyncio.sleep(POLL_S)

    async def _read_job(self, request: coordinator_pb2.GetJobRequest) -> coordinator_pb2.Job:
        return await self.client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE))

    async def _members(self) -> list[MemberRecord]:
        members, _ = await self.client.registry.list()
        return [m for m in members if m.job_id == self.options.job]

    def _targets(self, members: list[MemberRecord]) -> tuple[list[str], list[str]]:
        """(roles, faults) after --instance and what the job has; ChaosError if none fits."""
        options = self.options
        roles, faults = options.roles, options.faults
        if options.engine:
            wrong = set(faults) - {*ENGINE_FAULTS, "random"}
            if wrong or set(roles) - {"rollout", "random"}:
                raise ChaosError(
                    "--engine kills or hangs a rollout's engine process: "
                    "--fault kill or hang, --role rollout"
                )
            roles = ["rollout"]
            faults = [f for f in faults if f != "random"] or list(ENGINE_FAULTS)
        if options.instance:
            member = next((m for m in members if m.instance_id == options.instance), None)
            if member is None:
                serving = ", ".join(m.instance_id for m in members) or "none"
                raise ChaosError(
                    f"{options.instance} does not serve job {options.job} (its members: {serving})"
                )
            if member.role not in ROLES:
                raise ChaosError(f"{options.instance} is a {member.role}; chaos targets {ROLES}")
            roles = [member.role]
            signalled = set(options.faults or ["random"]) - CONTROL_FAULTS.keys()
            if options.engine:
                problem = engine_process(member)[1]
            else:
                problem = local_problem(member) if signalled else None
            if problem:
                raise ChaosError(problem)
        pairs = fault_choices(faults, roles)
        served = [
            (f, r)
            for f, r in pairs
            if any(m.role == r and can_take(m, f, options.engine) for m in members)
        ]
        if not served:
            wanted = " or ".join(sorted({r for _, r in pairs}))
            engine = " with its engine in a process of its own" if options.engine else ""
            raise ChaosError(f"no {wanted}{engine} serves job {options.job}")
        return sorted({r for _, r in served}), sorted({f for f, _ in served})

    async def _follow(self, plan: list[Injection]) -> None:
        request = coordinator_pb2.GetJobRequest(job_id=self.options.job)
        pending = list(plan)
        while pending:
            job = await self._read_job(request)
            if job.phase not in _LIVE:
                phase = phase_name(job)
                left = ", ".join(f"step {p.step} {p.fault}" for p in pending)
                self.say(f"job {job.job_id} {phase} at step {job.step}; not injected: {left}")
                return
            due = [p for p in pending if job.step >= p.step - lead(p.fault)]
            if due:
                members = await self._members()
                for injection in due:
                    pending.remove(injection)
                    try:
                        await self._inject(injection, job, members)
                    except grpc.aio.AioRpcError as exc:
                        # A trainer being recovered (fenced, gone) refuses; the plan goes on.
                        self.say(
                            f"step {injection.step}: {injection.fault} refused: "
                            f"{exc.code().name}: {exc.details()}"
                        )
            await asyncio.sleep(POLL_S)

    async def _inject(
        self, injection: Injection, job: coordinator_pb2.Job, members: list[MemberRecord]
    ) -> None:
        options = self.options
        if options.instance:
            victim: MemberRecord | None = next(
                (m for m in members if m.instance_id == options.instance), None
            )
        elif injection.fault in CONTROL_FAULTS:
            victim = choose(members, injection)
        elif options.engine:
            victim = choose([m for m in members if engine_process(m)[1] is None], injection)
        else:
            # Only processes this host can signal are candidates.
            local = [m for m in members if local_problem(m) is None]
            victim = choose(local, injection)
        if victim is None:
            what = options.instance or f"{injection.role} of job {options.job} on this host"
            if injection.step == 0:
                raise ChaosError(f"no {what} to {injection.fault}")
            self.say(f"step {injection.step}: no {what} to {injection.fault}; skipped")
            return
        step = int(job.step)
        pid = victim.pid
        if missed(injection, step + 1 if injection.fault in CONTROL_FAULTS else step):
            self.say(
                f"step {injection.step}: {injection.fault} missed its window, which ends at "
                f"step {injection.last}: the job is at step {step}; skipped"
            )
            return
        if injection.fault in CONTROL_FAULTS:
            taken = await self._control(victim, injection, step)
            if taken is None:
                self.say(
                    f"step {injection.step}: {injection.fault} came too late: its window has "
                    "no step left that an earlier fault did not take; skipped"
                )
                return
            step = taken
        else:
            if options.engine:
                pid, problem = engine_process(victim)
            else:
                problem = local_problem(victim)
            if problem:
                raise ChaosError(problem)
            if injection.fault in SIGNAL_FAULTS:
                os.kill(pid, SIGNAL_FAULTS[injection.fault])
            else:
                began = start_time(pid)
                os.kill(pid, signal.SIGSTOP)
                self._stopped[pid] = began
                if options.hang_for:
                    self._resumes.append(
                        asyncio.create_task(self._resume_later(victim, pid, options.hang_for))
                    )
        done = Injected(
            at=time.time(),
            step=step,
            fault=injection.fault,
            role=victim.role,
            instance_id=victim.instance_id,
            pid=pid,
            process="engine" if options.engine else "member",
        )
        self.injected.append(done)
        clock = time.strftime("%H:%M:%S", time.localtime(done.at))
        where = f"into step {step}" if injection.fault in CONTROL_FAULTS else f"at step {step}"
        after = ""
        if injection.fault == "hang":
            after = (
                f"; SIGCONT in {options.hang_for:g}s"
                if options.hang_for
                else f"; it stays stopped (kill -CONT {pid} resumes it)"
            )
        whose = "'s engine" if options.engine else ""
        self.say(
            f"{clock} {injection.fault} {where}: {victim.role} {victim.instance_id}{whose} "
            f"(pid {pid}){after}"
        )

    async def _control(
        self, victim: MemberRecord, injection: Injection, job_step: int
    ) -> int | None:
        """INJECT_NAN or INJECT_ERROR; the trainer answers with the step it takes. Never a step
        an earlier injection of this run took: a late fault would merge into it and be lost.
        None when the trainer could only put it into such a step, or one past the injection's
        window (the job is at its end, or the window is spent)."""
        args: dict[str, str] = {}
        taken = max((i.step for i in self.injected if i.fault in CONTROL_FAULTS), default=0)
        if injection.step or taken:
            target = control_target(injection, job_step, taken)
            if target is None:
                return None
            args["step"] = str(target)
        request = trainer_pb2.ControlRequest(
            action=CONTROL_FAULTS[injection.fault],
            job_id=self.options.job,
            epoch=victim.epoch,
            args=args,
        )
        step = await self._send(victim.address, request)
        return None if step <= taken else step

    async def _send(self, address: str, request: trainer_pb2.ControlRequest) -> int:
        """The Control call; the step the trainer put the fault into."""
        async with open_channel(address) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            try:
                reply = await stub.Control(request, timeout=DEFAULT_DEADLINE)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or "step" not in request.args:
                    raise
                # The trainer got further than the job record said: its next step, then.
                del request.args["step"]
                reply = await stub.Control(request, timeout=DEFAULT_DEADLINE)
        return int(reply.status.metrics[FAULT_STEP_KEY])

    async def _resume_later(self, victim: MemberRecord, pid: int, after: float) -> None:
        await asyncio.sleep(after)
        if self._resume(pid):
            clock = time.strftime("%H:%M:%S")
            self.say(f"{clock} resumed {victim.role} {victim.instance_id} (pid {pid})")

    def _resume(self, pid: int) -> bool:
        """SIGCONT a process we stopped, unless its pid now belongs to another process."""
        if pid not in self._stopped:
            return False
        began = self._stopped.pop(pid)
        if began is None or start_time(pid) != began:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        return True

    def _resume_all(self) -> None:
        """On the way out (done, Ctrl-C, SIGTERM): a timed hang must not outlive the command."""
        if self.options.hang_for:
            for pid in list(self._stopped):
                self._resume(pid)


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    parser.add_argument(
        "--fault",
        action="append",
        choices=[*FAULTS, "random"],
        help="kill (SIGKILL), hang (SIGSTOP), nan (a non-finite loss), error (the trainer "
        "stops on an error at a step) or stop (SIGTERM: a clean stop); repeat to choose among "
        "several (default: random, among all but stop)",
    )
    parser.add_argument(
        "--role", choices=[*ROLES, "random"], default="random", help="(default: random)"
    )
    parser.add_argument("--instance", default="", help="this member instead of a random one")
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="one fault now (the default)")
    when.add_argument(
        "--every-pct",
        type=float,
        metavar="P",
        help="one fault per P%% of the job's trainer.steps, at steps drawn from --seed",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the plan and the victims")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="kill or hang a rollout's inference engine process alone (vLLM's engine core); "
        "the rollout service stays up and keeps beating",
    )
    parser.add_argument(
        "--hang-for",
        type=float,
        metavar="SECONDS",
        help="SIGCONT a hung process after this long (default: it stays stopped)",
    )
    parser.add_argument("--json", action="store_true", help="print what was injected as JSON")


def options_from(args: argparse.Namespace) -> ChaosOptions:
    if args.hang_for is not None and not (math.isfinite(args.hang_for) and args.hang_for > 0):
        raise ChaosError(f"--hang-for must be a positive number of seconds, not {args.hang_for}")
    return ChaosOptions(
        job=args.job,
        faults=args.fault or ["random"],
        roles=[args.role],
        instance=args.instance,
        every_pct=args.every_pct,
        seed=args.seed,
        hang_for=args.hang_for,
        engine=args.engine,
    )


async def run(client: CoordinatorClient, args: argparse.Namespace) -> int:
    """The command: prints each injection as it happens (or, with --json, all at the end)."""
    options = options_from(args)
    # With --json, stdout is the JSON alone; the running commentary goes to stderr.
    stream = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    chaos = Chaos(client, options, say)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    stopped_by: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        stopped_by.append(signum)
        if task is not None:
            task.cancel()

    # Ctrl-C and SIGTERM end us through `finally`, which resumes what a timed hang stopped.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        injected = await chaos.run()
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        injected = chaos.injected
        say(f"stopped by {stopped_by[0].name}")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if args.json:
        print(json.dumps(as_dicts(injected), indent=2, sort_keys=True))
    return 128 + stopped_by[0] if stopped_by else 0


def as_dicts(injected: Sequence[Injected]) -> list[dict[str, Any]]:
    return [asdict(i) for i in injected]
