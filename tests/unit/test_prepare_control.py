"""PREPARE and BIND in RoleControl: a BIND of the prepared job takes the prepared worker."""

from __future__ import annotations

from typing import Any

import pytest

from robustrl.v1 import trainer_pb2
from services.common.errors import FailedPrecondition
from services.common.heartbeat import Progress
from services.common.jobspec import JobSpec
from services.common.registry import MemberRecord
from services.common.role_server import PREPARED_LABEL, RoleControl

Action = trainer_pb2.ControlRequest


class CountingWorker:
    def __init__(self, job_id: str, epoch: int, spec: JobSpec) -> None:
        self.job_id, self.epoch, self.spec = job_id, epoch, spec
        self.prepared = self.loaded = self.started = 0

    def prepare(self) -> None:
        if not self.prepared:
            self.prepared += 1

    def load(self) -> None:
        self.prepare()
        self.loaded += 1

    def start(self) -> None:
        self.started += 1

    async def stop(self) -> None: ...


class Runtime:
    """What RoleControl reads and writes of its service runtime, without etcd."""

    role = "trainer"
    instance_id = "standby-0"

    def __init__(self) -> None:
        self.settings: Any = type("S", (), {"epoch": 0})()
        self.progress = Progress()
        self.member = MemberRecord(
            role="trainer",
            instance_id="standby-0",
            address="h:1",
            pid=1,
            host="h",
            labels={"standby": "true"},
        )

    async def update_member(
        self, *, labels: dict[str, str | None] | None = None, **changes: Any
    ) -> None:
        self.member = self.member.changed(labels, **changes)


def control() -> tuple[RoleControl, Runtime, list[CountingWorker]]:
    made: list[CountingWorker] = []

    def make(job_id: str, epoch: int, spec: JobSpec) -> CountingWorker:
        made.append(CountingWorker(job_id, epoch, spec))
        return made[-1]

    runtime = Runtime()
    return RoleControl(runtime, make), runtime, made  # type: ignore[arg-type]


def request(
    action: Action.Action.ValueType, job: str, epoch: int, spec: JobSpec
) -> trainer_pb2.ControlRequest:
    return Action(
        action=action, job_id=job, epoch=epoch, args={"spec_json": spec.model_dump_json()}
    )


SPEC = JobSpec(name="j")


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
