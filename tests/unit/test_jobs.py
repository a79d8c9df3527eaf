from __future__ import annotations

import json

import pytest

from robustrl.contracts.errors import FailedPrecondition
from robustrl.v1 import coordinator_pb2
from services.coordinator.jobs import ALLOWED, TERMINAL, Phase, new_job, to_proto, transition


def test_happy_path_and_recovery_loop() -> None:
    job = new_job("j", {"name": "x"}, now=1.0)
    assert job.phase is Phase.PENDING
    job = transition(job, Phase.RUNNING, "", 2.0)
    job = transition(job, Phase.RECOVERING, "trainer lost", 3.0)
    job = transition(job, Phase.RUNNING, "", 4.0)
    job = transition(job, Phase.SUCCEEDED, "done", 5.0)
    assert job.phase is Phase.SUCCEEDED and job.updated_at == 5.0 and job.message == "done"


@pytest.mark.parametrize("phase", sorted(TERMINAL))
def test_terminal_phases_accept_nothing(phase: Phase) -> None:
    job = new_job("j", {}, 0.0).model_copy(update={"phase": phase})
    for target in Phase:
        with pytest.raises(FailedPrecondition, match="already"):
            transition(job, target, "", 1.0)


def test_pending_cannot_succeed_or_recover() -> None:
    job = new_job("j", {}, 0.0)
    for target in (Phase.SUCCEEDED, Phase.RECOVERING):
        with pytest.raises(FailedPrecondition):
            transition(job, target, "", 1.0)


def test_every_non_terminal_phase_can_be_cancelled() -> None:
    for phase, targets in ALLOWED.items():
        assert (Phase.CANCELLED in targets) == (phase not in TERMINAL)


def test_proto_conversion_keeps_what_a_client_reads() -> None:
    job = new_job("j", {"name": "x", "seed": 3}, 10.5).model_copy(
        update={"step": 4, "metrics": {"reward": 0.5}}
    )
    proto = to_proto(job, revision=42)
    assert proto.phase == coordinator_pb2.JOB_PHASE_PENDING
    assert proto.revision == 42 and proto.step == 4
    assert json.loads(proto.spec_json) == {"name": "x", "seed": 3}
    assert proto.metrics["reward"] == 0.5
    assert proto.created_at.ToNanoseconds() == 10_500_000_000
