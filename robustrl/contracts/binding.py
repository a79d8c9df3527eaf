"""Binding and fencing of a data-plane instance (trainer or rollout) — pure state transitions.

The coordinator binds an instance to a job with an epoch. A request carrying a lower epoch
than the instance has seen is from a stale coordinator decision and is refused; once fenced,
an instance refuses everything, so a zombie that comes back changes nothing. INJECT_NAN and
INJECT_ERROR (chaos) and PREPARE (a free standby builds a job's model ahead) are checked like
the others but leave the binding as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from robustrl.contracts.errors import FailedPrecondition, Fenced, InvalidArgument
from robustrl.v1 import trainer_pb2

Action = trainer_pb2.ControlRequest.Action

FIRST_EPOCH = 1
"""The epoch a job's first members are bound at; each trainer replacement binds at one more."""


@dataclass(frozen=True)
class Binding:
    job_id: str = ""
    epoch: int = 0
    fenced: bool = False
    epoch_job: str = ""
    """The job `epoch` counts in: the job bound now, or the last one (kept after RELEASE).
    Epochs are per job: a trainer that served job A at epoch 3 is bound to job B at epoch 1."""


def apply_control(binding: Binding, action: int, job_id: str, epoch: int) -> Binding:
    if binding.fenced:
        raise Fenced(f"this instance was fenced at epoch {binding.epoch}; it accepts nothing")
    counted_in = binding.job_id or binding.epoch_job
    if (not job_id or not counted_in or job_id == counted_in) and epoch < binding.epoch:
        raise FailedPrecondition(
            f"request epoch {epoch} is older than this instance's epoch {binding.epoch}"
        )
    if action == Action.ACTION_BIND:
        if not job_id:
            raise InvalidArgument("BIND needs a job_id")
        if binding.job_id and binding.job_id != job_id:
            raise FailedPrecondition(f"already bound to job {binding.job_id}; release it first")
        return replace(binding, job_id=job_id, epoch=epoch, epoch_job=job_id)
    if action == Action.ACTION_RELEASE:
        if binding.job_id and job_id and job_id != binding.job_id:
            raise FailedPrecondition(f"bound to job {binding.job_id}, not {job_id}")
        return replace(binding, job_id="", epoch=epoch, epoch_job=job_id or counted_in)
    if action == Action.ACTION_FENCE:
        if counted_in and job_id and job_id != counted_in:
            # A fence from an earlier job's recovery, late: this instance has moved on.
            raise FailedPrecondition(f"serves job {counted_in}, not {job_id}")
        return replace(binding, epoch=epoch, fenced=True, epoch_job=job_id or counted_in)
    if action in (Action.ACTION_INJECT_NAN, Action.ACTION_INJECT_ERROR):
        # Chaos acts on the job this instance works on; it never changes who is bound.
        if not binding.job_id:
            raise FailedPrecondition("not bound to a job; there is no step to inject a fault into")
        if job_id and job_id != binding.job_id:
            raise FailedPrecondition(f"bound to job {binding.job_id}, not {job_id}")
        return binding
    if action == Action.ACTION_PREPARE:
        if not job_id:
            raise InvalidArgument("PREPARE needs a job_id")
        if binding.job_id:
            raise FailedPrecondition(
                f"bound to job {binding.job_id}; only a free instance prepares for a job"
            )
        return binding
    raise InvalidArgument(f"unknown control action {action}")
