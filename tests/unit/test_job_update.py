"""A job's step budget changed while it runs: the pure rules (coordinator jobs) and what a
prepared worker keeps serving (role_server)."""

from __future__ import annotations

import pytest

from robustrl.contracts.errors import FailedPrecondition, InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.role_server import budgetless
from services.coordinator.jobs import (
    JobRecord,
    Phase,
    new_job,
    requested_steps,
    transition,
    with_steps,
)


def running(step: int, **trainer: object) -> JobRecord:
    spec = JobSpec.model_validate({"name": "a", "trainer": {"steps": 100, **trainer}})
    record = transition(new_job("a", spec.model_dump(mode="json"), 0.0), Phase.RUNNING, "", 0.0)
    return record.model_copy(update={"step": step})


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ([], "trainer.steps"),
        (["trainer.lr=0.1"], "trainer.lr"),
        (["trainer.steps=5", "seed=3"], "seed"),
        (["trainer.steps"], "key.sub=value"),
        (["trainer.steps=x"], "trainer.steps"),
        (["trainer.steps=2.5"], "trainer.steps"),
        (["trainer.steps=false"], "trainer.steps"),
    ],
)
def test_anything_but_a_whole_step_budget_is_refused_naming_it(
    overrides: list[str], names: str
) -> None:
    with pytest.raises(InvalidArgument, match=names):
        requested_steps(overrides)


def test_a_budget_is_taken_beyond_the_step_and_the_plan_stays() -> None:
    record = running(step=10)
    lowered = with_steps(record, 11, now=5.0)
    trainer = JobSpec.model_validate(lowered.spec).trainer
    assert (trainer.steps, trainer.lr_decay_steps, trainer.planned_steps) == (11, 100, 100)
    assert lowered.updated_at == 5.0 and lowered.step == 10
    raised = with_steps(lowered, 400, now=6.0)
    assert JobSpec.model_validate(raised.spec).trainer.planned_steps == 100
    assert with_steps(raised, 400, now=7.0) is raised  # nothing to change
    # A plan the user set at submit is the one kept.
    planned = with_steps(running(step=0, lr_decay_steps=30), 50, now=1.0)
    assert JobSpec.model_validate(planned.spec).trainer.lr_decay_steps == 30


@pytest.mark.parametrize(
    ("step", "steps", "error", "text"),
    [
        (10, 9, FailedPrecondition, "at step 10"),
        (10, 10, FailedPrecondition, "at step 10"),
        (100, 120, FailedPrecondition, "the last of its 100"),
        (10, 0, InvalidArgument, "trainer.steps"),
    ],
)
def test_a_budget_too_late_or_out_of_bounds_is_refused(
    step: int, steps: int, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        with_steps(running(step=step), steps, now=1.0)


@pytest.mark.parametrize("phase", [Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED])
def test_an_ended_job_keeps_its_budget(phase: Phase) -> None:
    record = transition(running(step=3), phase, "", 0.0)
    with pytest.raises(FailedPrecondition, match=f"already {phase.value}"):
        with_steps(record, 50, now=1.0)


def test_a_worker_prepared_before_an_update_serves_the_job_after_it() -> None:
    before = JobSpec.model_validate({"name": "a", "trainer": {"steps": 100}})
    after = JobSpec.model_validate(with_steps(running(step=1), 20, now=1.0).spec)
    assert budgetless(before) == budgetless(after)
    other = JobSpec.model_validate({"name": "a", "trainer": {"steps": 100, "lr": 0.5}})
    assert budgetless(other) != budgetless(before)
    replanned = JobSpec.model_validate(
        {"name": "a", "trainer": {"steps": 100, "lr_decay_steps": 7}}
    )
    assert budgetless(replanned) != budgetless(before)
