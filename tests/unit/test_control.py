from __future__ import annotations

import pytest

from robustrl.contracts.binding import Action, Binding, apply_control
from robustrl.contracts.errors import FailedPrecondition, Fenced, InvalidArgument


def test_bind_release_rebind() -> None:
    b = apply_control(Binding(), Action.ACTION_BIND, "j1", 1)
    assert (b.job_id, b.epoch) == ("j1", 1)
    with pytest.raises(FailedPrecondition, match="already bound"):
        apply_control(b, Action.ACTION_BIND, "j2", 1)
    b = apply_control(b, Action.ACTION_RELEASE, "j1", 1)
    assert apply_control(b, Action.ACTION_BIND, "j2", 2).job_id == "j2"


def test_stale_epoch_is_refused() -> None:
    b = Binding(job_id="j", epoch=3)
    with pytest.raises(FailedPrecondition, match="older"):
        apply_control(b, Action.ACTION_RELEASE, "j", 2)


def test_epochs_are_per_job_so_a_trainer_of_a_recovered_job_serves_the_next() -> None:
    # It replaced job j's trainer at epoch 3, and job j ended.
    b = apply_control(Binding(), Action.ACTION_BIND, "j", 3)
    b = apply_control(b, Action.ACTION_RELEASE, "j", 3)
    with pytest.raises(FailedPrecondition, match="older"):
        apply_control(b, Action.ACTION_BIND, "j", 2)  # a stale BIND of j: still refused
    b = apply_control(b, Action.ACTION_BIND, "k", 1)  # job k counts its own epochs
    assert (b.job_id, b.epoch, b.epoch_job) == ("k", 1, "k")
    # A late fence from j's recovery does not touch it now that it serves k.
    with pytest.raises(FailedPrecondition, match="serves job k, not j"):
        apply_control(b, Action.ACTION_FENCE, "j", 4)
    free = apply_control(b, Action.ACTION_RELEASE, "k", 1)
    with pytest.raises(FailedPrecondition, match="serves job k, not j"):
        apply_control(free, Action.ACTION_FENCE, "j", 4)
    assert apply_control(b, Action.ACTION_FENCE, "k", 2).fenced


def test_fenced_instance_accepts_nothing() -> None:
    b = apply_control(Binding(job_id="j", epoch=1), Action.ACTION_FENCE, "j", 2)
    for action in (Action.ACTION_BIND, Action.ACTION_RELEASE, Action.ACTION_FENCE):
        with pytest.raises(Fenced):
            apply_control(b, action, "j", 9)


def test_bind_needs_a_job() -> None:
    with pytest.raises(InvalidArgument):
        apply_control(Binding(), Action.ACTION_BIND, "", 0)


def test_prepare_leaves_the_binding_and_is_for_free_instances_only() -> None:
    free = Binding(epoch=2)
    assert apply_control(free, Action.ACTION_PREPARE, "j", 2) == free
    with pytest.raises(InvalidArgument, match="PREPARE needs a job_id"):
        apply_control(free, Action.ACTION_PREPARE, "", 2)
    with pytest.raises(FailedPrecondition, match="only a free instance prepares"):
        apply_control(Binding(job_id="j", epoch=1), Action.ACTION_PREPARE, "j", 1)
    with pytest.raises(Fenced):
        apply_control(Binding(fenced=True), Action.ACTION_PREPARE, "j", 0)
