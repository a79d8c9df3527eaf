"""A data-plane role's control (bind, prepare, fence) with a worker that only counts."""

from __future__ import annotations

from typing import Any

from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.members import MemberRecord
from robustrl.core.heartbeat import Progress
from robustrl.v1 import trainer_pb2

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


def request(
    action: Action.Action.ValueType, job: str, epoch: int, spec: JobSpec
) -> trainer_pb2.ControlRequest:
    return Action(
        action=action, job_id=job, epoch=epoch, args={"spec_json": spec.model_dump_json()}
    )


SPEC = JobSpec(name="j")
