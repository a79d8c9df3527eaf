"""UpdateJob against real coordinator replicas and a real etcd: the codes, the record left as it
was by every refusal, and the new step budget reaching the trainer in its progress replies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable

import grpc
import pytest

from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import coordinator_pb2 as pb
from robustrl.v1 import coordinator_pb2_grpc
from services.coordinator.jobs import Phase, new_job, transition
from services.coordinator.store import JobStore
from tests.support.cluster import SPEC, code_of, start_coordinators, started_member, stub

JOB = "up"
TRAINER = "trainer-up"


@pytest.fixture
async def coordinators(etcd_settings: EtcdSettings) -> AsyncIterator[list[ServiceRuntime]]:
    """Two replicas, leader first, that start no members of their own (provisioner none)."""
    runtimes = await start_coordinators(etcd_settings, provisioner="none")
    yield runtimes
    for runtime in runtimes:
        await runtime.shutdown()


@pytest.fixture
async def trainer(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    """A registry member bound to the job: whose reports the leader takes."""
    runtime = await started_member("trainer", TRAINER, etcd_settings)
    await runtime.update_member(job_id=JOB, epoch=1)
    yield runtime
    await runtime.shutdown()


async def running_job(leader: ServiceRuntime, steps: int) -> None:
    """A running job of `steps` steps whose trainer is TRAINER, stored as a leader would."""
    assert leader.client is not None
    spec: dict[str, object] = {
        "name": "arith",
        "id": JOB,
        "trainer": {"steps": steps},
        "rollout": {"replicas": 1},
    }
    record = transition(new_job(JOB, spec, 0.0), Phase.RUNNING, "running", now=0.0)
    record = record.model_copy(update={"members": [TRAINER], "member_roles": {TRAINER: "trainer"}})
    await JobStore(leader.client, leader.keys).create(record, [])


async def report(
    api: coordinator_pb2_grpc.CoordinatorStub, step: int, *, finished: bool = False
) -> pb.ReportProgressResponse:
    request = pb.ReportProgressRequest(
        job_id=JOB, instance_id=TRAINER, epoch=1, step=step, weight_version=step, finished=finished
    )
    reply: pb.ReportProgressResponse = await api.ReportProgress(request, timeout=5)
    return reply


def update(
    api: coordinator_pb2_grpc.CoordinatorStub, *overrides: str, job_id: str = JOB
) -> Awaitable[pb.Job]:
    return api.UpdateJob(pb.UpdateJobRequest(job_id=job_id, overrides=list(overrides)), timeout=5)


def steps_of(job: pb.Job) -> dict[str, int]:
    trainer = json.loads(job.spec_json)["trainer"]
    return {"steps": trainer["steps"], "lr_decay_steps": trainer["lr_decay_steps"]}


async def test_a_refused_update_names_why_and_leaves_the_record_as_it_was(
    coordinators: list[ServiceRuntime], trainer: ServiceRuntime
) -> None:
    leader, follower = coordinators
    await running_job(leader, steps=100)
    channel, api = stub(leader)
    async with channel:
        assert (await report(api, 5)).steps == 100
        before = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
        assert before.step == 5 and before.phase == pb.JOB_PHASE_RUNNING
        cases = [
            (update(api, "trainer.steps=50", job_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
            (update(api, "trainer.lr=1e-5"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.lr"),
            (
                update(api, "trainer.steps=50", "rollout.replicas=4"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "rollout.replicas",
            ),
            (update(api), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            (update(api, "trainer.steps=0"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            (update(api, "trainer.steps=-3"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            (update(api, "trainer.steps=ten"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            (update(api, "trainer.steps=7.5"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            (update(api, "trainer.steps=true"), grpc.StatusCode.INVALID_ARGUMENT, "trainer.steps"),
            # Passed, and reached: the trainer has done 5 steps and may be in its 6th.
            (update(api, "trainer.steps=4"), grpc.StatusCode.FAILED_PRECONDITION, "at step 5"),
            (update(api, "trainer.steps=5"), grpc.StatusCode.FAILED_PRECONDITION, "at step 5"),
            (
                api.UpdateJob(
                    pb.UpdateJobRequest(
                        job_id=JOB, overrides=["trainer.steps=50"], expected_revision=1
                    ),
                    timeout=5,
                ),
                grpc.StatusCode.ABORTED,
                "revision",
            ),
        ]
        for call, code, text in cases:
            error = await code_of(call)
            assert error.code() == code, (code, error.details())
            assert text in (error.details() or ""), error.details()
            after = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
            assert after.revision == before.revision and after == before

        # Ended by a cancel: refused, unchanged.
        await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="cx"), timeout=5)
        cancelled = await api.CancelJob(pb.CancelJobRequest(job_id="cx"), timeout=5)
        error = await code_of(update(api, "trainer.steps=50", job_id="cx"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already CANCELLED" in (error.details() or "")
        assert await api.GetJob(pb.GetJobRequest(job_id="cx"), timeout=5) == cancelled

    # A write to a follower: UNAVAILABLE, as every other write, and nothing changes.
    f_channel, f_api = stub(follower)
    async with f_channel:
        error = await code_of(update(f_api, "trainer.steps=50"))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert (await f_api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)) == before


async def test_the_new_budget_reaches_the_trainer_and_the_job_ends_at_it(
    coordinators: list[ServiceRuntime], trainer: ServiceRuntime
) -> None:
    """Lowered from 100 to 8 at step 5: the trainer's next report is answered with 8, the
    learning rate keeps its 100-step horizon, and the job succeeds at step 8. Then no update
    takes: a finishing job (at its last step) and an ended one are refused, unchanged."""
    leader, _ = coordinators
    await running_job(leader, steps=100)
    channel, api = stub(leader)
    async with channel:
        await report(api, 5)
        before = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
        updated = await update(api, "trainer.steps=8")
        assert updated.revision > before.revision
        assert steps_of(updated) == {"steps": 8, "lr_decay_steps": 100}
        assert updated.step == 5 and updated.phase == pb.JOB_PHASE_RUNNING
        got = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
        assert got == updated
        # The same budget again is answered with the job as it is, and writes nothing.
        again = await update(api, "trainer.steps=8")
        assert again == got

        assert (await report(api, 6)).steps == 8
        # Raised again before the end: the horizon stays the one the job was planned for.
        raised = await update(api, "trainer.steps=9")
        assert steps_of(raised) == {"steps": 9, "lr_decay_steps": 100}
        assert (await report(api, 7)).steps == 9
        reply = await report(api, 9)
        assert reply.keep_going and reply.steps == 9

        finishing = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
        error = await code_of(update(api, "trainer.steps=20"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "at step 9, the last of its 9" in (error.details() or "")
        assert await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5) == finishing

        assert not (await report(api, 9, finished=True)).keep_going
        done = await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5)
        assert done.phase == pb.JOB_PHASE_SUCCEEDED
        assert done.message == "completed 9/9 steps"
        error = await code_of(update(api, "trainer.steps=20"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already SUCCEEDED" in (error.details() or "")
        assert await api.GetJob(pb.GetJobRequest(job_id=JOB), timeout=5) == done
