"""Job records and the job state machine — pure functions of (record, request, now).

PENDING -> RUNNING -> SUCCEEDED
RUNNING <-> RECOVERING
PENDING | RUNNING | RECOVERING -> FAILED | CANCELLED
"""

from __future__ import annotations

import enum
import time

import yaml
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import BaseModel, Field, ValidationError

from robustrl.contracts.errors import FailedPrecondition, InvalidArgument, describe_validation_error
from robustrl.contracts.jobspec import JobSpec
from robustrl.v1 import coordinator_pb2


class Phase(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED})

ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.RUNNING, Phase.FAILED, Phase.CANCELLED}),
    Phase.RUNNING: frozenset({Phase.RECOVERING, Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}),
    Phase.RECOVERING: frozenset({Phase.RUNNING, Phase.FAILED, Phase.CANCELLED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}


class JobRecord(BaseModel):
    """A job as stored in etcd at <prefix>/jobs/<job_id> (JSON)."""

    job_id: str
    phase: Phase = Phase.PENDING
    spec: dict[str, object]
    message: str = ""
    created_at: float
    updated_at: float
    step: int = 0
    weight_version: int = 0
    members: list[str] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    epoch: int = 1
    """Binding epoch of the job's current members; a replacement is bound at a higher one."""
    member_roles: dict[str, str] = Field(default_factory=dict)
    """instance id -> role, for the members serving the job now."""
    member_ranks: dict[str, int] = Field(default_factory=dict)
    """trainer instance id -> its rank in the job's trainer group (rank 0 takes the
    trajectories, publishes and reports), for the trainers serving the job now."""


def new_job(job_id: str, spec: dict[str, object], now: float) -> JobRecord:
    return JobRecord(job_id=job_id, spec=spec, created_at=now, updated_at=now)


def transition(record: JobRecord, target: Phase, message: str, now: float) -> JobRecord:
    """The record moved to `target`, or FailedPrecondition if the state machine forbids it."""
    if target not in ALLOWED[record.phase]:
        if record.phase in TERMINAL:
            raise FailedPrecondition(
                f"job {record.job_id} is already {record.phase.value}; it cannot become "
                f"{target.value}"
            )
        raise FailedPrecondition(
            f"job {record.job_id} is {record.phase.value}; it cannot become {target.value}"
        )
    return record.model_copy(update={"phase": target, "message": message, "updated_at": now})


UPDATABLE = ("trainer.steps",)
"""The spec fields UpdateJob may change on a submitted job. The step budget alone: every other
field shapes what the job's members built (model, optimizer, data) and is read only then."""


def requested_steps(overrides: list[str]) -> int:
    """The step budget an UpdateJob asks for; InvalidArgument naming the field for anything
    but one whole `trainer.steps=N` (its bounds are the spec's, checked by `with_steps`)."""
    if not overrides:
        raise InvalidArgument("name what to change as key=value, e.g. trainer.steps=120")
    steps: int | None = None
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise InvalidArgument(f"override {item!r} is not of the form key.sub=value")
        if path not in UPDATABLE:
            raise InvalidArgument(
                f"{path}: cannot change on a submitted job; only {', '.join(UPDATABLE)} can"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        # YAML reads `true` as a bool, which is an int to Python (and to pydantic's lax mode).
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{path}: {raw!r} is not a whole number of steps")
        steps = value
    assert steps is not None
    return steps


def with_steps(record: JobRecord, steps: int, now: float) -> JobRecord:
    """The record with its spec's step budget changed to `steps`, or the record itself when it
    is that already. What the job was planned for stays (`TrainerSpec.planned_steps`, pinned
    here in `lr_decay_steps` on the first change). FailedPrecondition for an ended job, one
    that has done its budget (it is finishing), and one at `steps` or past it: the change would
    come too late for the step it names."""
    if record.phase in TERMINAL:
        raise FailedPrecondition(
            f"job {record.job_id} is already {record.phase.value}; its step budget cannot change"
        )
    spec = JobSpec.model_validate(record.spec)
    if steps == spec.trainer.steps:
        return record
    trainer = spec.trainer.model_dump() | {"steps": steps}
    trainer["lr_decay_steps"] = spec.trainer.planned_steps
    try:
        updated = JobSpec.model_validate(spec.model_dump() | {"trainer": trainer})
    except ValidationError as exc:
        raise InvalidArgument("invalid update: " + describe_validation_error(exc)) from exc
    if record.step >= spec.trainer.steps:
        raise FailedPrecondition(
            f"job {record.job_id} is at step {record.step}, the last of its "
            f"{spec.trainer.steps}, and is finishing; its step budget cannot change"
        )
    if steps <= record.step:
        raise FailedPrecondition(
            f"job {record.job_id} is at step {record.step}: trainer.steps={steps} must be beyond "
            "it (cancel the job to stop it now)"
        )
    return record.model_copy(update={"spec": updated.model_dump(mode="json"), "updated_at": now})


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def to_proto(record: JobRecord, revision: int) -> coordinator_pb2.Job:
    import json

    job = coordinator_pb2.Job(
        job_id=record.job_id,
        phase=coordinator_pb2.JobPhase.Value(f"JOB_PHASE_{record.phase.value}"),
        spec_json=json.dumps(record.spec, sort_keys=True),
        message=record.message,
        created_at=_timestamp(record.created_at),
        updated_at=_timestamp(record.updated_at),
        revision=revision,
        step=record.step,
        weight_version=record.weight_version,
        members=record.members,
    )
    job.metrics.update(record.metrics)
    return job


def phase_from_proto(value: int) -> Phase:
    name = coordinator_pb2.JobPhase.Name(value).removeprefix("JOB_PHASE_")  # type: ignore[arg-type]
    return Phase(name)


def now() -> float:
    return time.time()
