"""The trainer's intake: de-duplication, group assembly, the staleness bound."""

from __future__ import annotations

from robustrl.v1 import trainer_pb2
from services.trainer.intake import Intake


def traj(
    group: str, i: int, version: int = 0, job: str = "j", size: int = 2
) -> trainer_pb2.Trajectory:
    return trainer_pb2.Trajectory(
        trajectory_id=f"{group}/{i}",
        job_id=job,
        group_id=group,
        group_size=size,
        weight_version=version,
        completion_ids=[1, 2],
        logprobs=[-0.1, -0.2],
        reward=float(i),
    )


def test_groups_fill_then_train_once() -> None:
    intake = Intake("j", max_staleness=1)
    assert intake.offer(traj("g1", 0)) == ("received", "")
    assert intake.offer(traj("g1", 0))[0] == "received"  # a re-send is harmless
    assert intake.take_batch(0, 1) == ([], [])  # g1 is not complete yet
    intake.offer(traj("g1", 1))
    batch, dropped = intake.take_batch(0, 1)
    assert [g.group_id for g in batch] == ["g1"] and not dropped
    intake.mark_trained(batch)
    assert intake.offer(traj("g1", 0)) == ("committed", "already trained")


def test_batches_wait_for_enough_groups() -> None:
    intake = Intake("j", max_staleness=0)
    for i in range(2):
        intake.offer(traj("a", i))
    assert intake.take_batch(0, 2) == ([], [])
    for i in range(2):
        intake.offer(traj("b", i))
    batch, _ = intake.take_batch(0, 2)
    assert [g.group_id for g in batch] == ["a", "b"] and not intake.groups


def test_stale_groups_are_dropped_and_never_trained() -> None:
    intake = Intake("j", max_staleness=1)
    for i in range(2):
        intake.offer(traj("old", i, version=1))
        intake.offer(traj("new", i, version=2))
    batch, dropped = intake.take_batch(3, 1)  # 3 - 1 > 1: old is stale; 3 - 2 <= 1: new is fine
    assert [g.group_id for g in batch] == ["new"]
    assert [(g.group_id, "stale" in why) for g, why in dropped] == [("old", True)]
    assert intake.offer(traj("old", 0, version=1))[0] == "rejected"


def test_a_group_mixing_versions_counts_as_its_oldest() -> None:
    intake = Intake("j", max_staleness=0)
    intake.offer(traj("g", 0, version=4))
    intake.offer(traj("g", 1, version=5))
    batch, dropped = intake.take_batch(5, 1)
    assert not batch and [g.group_id for g, _ in dropped] == ["g"]


def test_malformed_or_foreign_trajectories_are_rejected() -> None:
    intake = Intake("j", max_staleness=1)
    assert intake.offer(traj("g", 0, job="other"))[0] == "rejected"
    bad = traj("g", 0)
    del bad.logprobs[:]
    assert intake.offer(bad)[0] == "rejected"
    assert not intake.groups
