"""Job records and the job state machine — pure functions of (record, request, now).

PENDING -> RUNNING -> SUCCEEDED
RUNNING <-> RECOVERING
PENDING | RUNNING | RECOVERING -> FAILED | CANCELLED
"""

from __future__ import annotations

import enum
import time

from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import BaseModel, Field

from robustrl.contracts.errors import FailedPrecondition
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
