"""BIND with a rank in RoleControl: a trainer bound as rank r > 0 labels itself while bound and
drops the labels when it leaves; a rank for a worker without one, or a rank that is not a
number, is refused; chaos faults go to rank 0 only. And the job spec refuses a fault on a rank
its group does not have."""

from __future__ import annotations

import pytest

from robustrl.contracts.errors import FailedPrecondition, InvalidArgument
from robustrl.contracts.jobspec import JobSpec, parse_spec
from robustrl.core.role_server import RoleControl
from robustrl.v1 import trainer_pb2
from tests.support.role_control import SPEC, Action, CountingWorker, Runtime


class RankedWorker(CountingWorker):
    rank = 0
    step = 0

    def inject_nan(self, step: int) -> None: ...

    def inject_error(self, step: int) -> None: ...


def bind(rank: str, *, job: str = "j", epoch: int = 2) -> trainer_pb2.ControlRequest:
    args = {"spec_json": SPEC.model_dump_json(), "rank": rank}
    return Action(action=Action.ACTION_BIND, job_id=job, epoch=epoch, args=args)


def control(worker: type[CountingWorker]) -> tuple[RoleControl, Runtime]:
    def make(job_id: str, epoch: int, spec: JobSpec) -> CountingWorker:
        return worker(job_id, epoch, spec)

    runtime = Runtime()
    runtime.settings.exit_when_fenced = False
    return RoleControl(runtime, make), runtime  # type: ignore[arg-type]


async def test_a_rank_above_0_is_labelled_while_bound_and_unlabelled_when_released() -> None:
    role, runtime = control(RankedWorker)
    await role.Control(bind("1"), context=None)
    assert isinstance(role.worker, RankedWorker) and role.worker.rank == 1
    assert (runtime.member.job_id, runtime.member.epoch) == ("j", 2)
    assert runtime.member.labels["rank"] == "1" and runtime.member.labels["follower"] == "true"
    with pytest.raises(FailedPrecondition, match=r"rank 1 of its group.*goes to rank 0"):
        await role.Control(
            Action(action=Action.ACTION_INJECT_ERROR, job_id="j", epoch=2), context=None
        )
    release = Action(action=Action.ACTION_RELEASE, job_id="j", epoch=2)
    await role.Control(release, context=None)
    assert runtime.member.job_id == ""
    assert "rank" not in runtime.member.labels and "follower" not in runtime.member.labels


async def test_rank_0_carries_no_rank_label_and_a_fence_drops_a_ranks_labels() -> None:
    role, runtime = control(RankedWorker)
    await role.Control(bind("0"), context=None)
    assert "rank" not in runtime.member.labels and "follower" not in runtime.member.labels
    role2, runtime2 = control(RankedWorker)
    await role2.Control(bind("3"), context=None)
    await role2.Control(Action(action=Action.ACTION_FENCE, job_id="j", epoch=2), context=None)
    assert runtime2.member.labels.get("fenced") == "true"
    assert "rank" not in runtime2.member.labels and runtime2.member.job_id == ""


async def test_a_rank_for_a_worker_without_one_or_not_a_number_is_refused() -> None:
    role, runtime = control(CountingWorker)
    with pytest.raises(InvalidArgument, match="has no rank"):
        await role.Control(bind("1"), context=None)
    role, runtime = control(RankedWorker)
    with pytest.raises(InvalidArgument, match="must be a rank"):
        await role.Control(bind("-1"), context=None)
    assert role.worker is None and runtime.member.job_id == ""


def test_a_fault_on_a_rank_the_group_does_not_have_is_refused_naming_the_field() -> None:
    base = "name: j\ntrainer: {world_size: 2}\n"
    parse_spec(base, ["faults.nan_rank=1", "faults.error_rank=1"])
    for field in ("nan_rank", "error_rank"):
        with pytest.raises(InvalidArgument, match=rf"faults\.{field}: rank 2 does not exist"):
            parse_spec(base, [f"faults.{field}=2"])
