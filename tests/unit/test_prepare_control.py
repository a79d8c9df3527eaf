"""PREPARE and BIND in RoleControl: a BIND of the prepared job takes the prepared worker."""

from __future__ import annotations

import pytest

from robustrl.contracts.errors import FailedPrecondition
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.role_server import PREPARED_LABEL, RoleControl
from tests.support.role_control import SPEC, Action, CountingWorker, Runtime, request


def control() -> tuple[RoleControl, Runtime, list[CountingWorker]]:
    made: list[CountingWorker] = []

    def make(job_id: str, epoch: int, spec: JobSpec) -> CountingWorker:
        made.append(CountingWorker(job_id, epoch, spec))
        return made[-1]

    runtime = Runtime()
    return RoleControl(runtime, make), runtime, made  # type: ignore[arg-type]


async def test_a_bind_of_the_prepared_job_takes_the_prepared_worker() -> None:
    role, runtime, made = control()
    await role.Control(request(Action.ACTION_PREPARE, "j", 0, SPEC), context=None)
    await role.Control(request(Action.ACTION_PREPARE, "j", 0, SPEC), context=None)  # idempotent
    assert len(made) == 1 and made[0].prepared == 1 and made[0].loaded == 0
    assert runtime.member.labels[PREPARED_LABEL] == "j" and role.binding.job_id == ""

    await role.Control(request(Action.ACTION_BIND, "j", 3, SPEC), context=None)
    assert len(made) == 1 and role.worker is made[0]
    assert (made[0].epoch, made[0].loaded, made[0].started) == (3, 1, 1)
    assert PREPARED_LABEL not in runtime.member.labels
    assert (role.binding.job_id, role.binding.epoch) == ("j", 3)
    # Beats carry the binding, which the monitor's fence check compares with a fence's epoch.
    assert (runtime.progress.job_id, runtime.progress.epoch) == ("j", 3)
    assert (runtime.member.job_id, runtime.member.epoch) == ("j", 3)
    with pytest.raises(FailedPrecondition, match="only a free instance"):
        await role.Control(request(Action.ACTION_PREPARE, "j", 3, SPEC), context=None)


async def test_a_bind_of_another_job_or_spec_builds_afresh() -> None:
    for job, spec in (("other", SPEC), ("j", JobSpec(name="j", seed=7))):
        role, runtime, made = control()
        await role.Control(request(Action.ACTION_PREPARE, "j", 0, SPEC), context=None)
        await role.Control(request(Action.ACTION_BIND, job, 2, spec), context=None)
        assert len(made) == 2 and role.worker is made[1]
        assert made[1].spec == spec and made[1].loaded == 1
        assert PREPARED_LABEL not in runtime.member.labels
