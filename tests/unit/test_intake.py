"""The trainer's intake: de-duplication, group assembly, the staleness bound."""

from __future__ import annotations

import json

import pytest

from robustrl.contracts.ids import group_id
from robustrl.v1 import trainer_pb2
from services.trainer import intake as intake_module
from services.trainer.intake import Intake, TrainedGroups


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


def test_a_copy_arriving_while_its_group_trains_is_not_trained_again() -> None:
    """CI, standby rollout chaos test: a rollout sent a group and died before it completed
    its lease; the group was leased again, made again, and its copy arrived while the first
    trained. It became a new group and the next step trained it a second time."""
    intake = Intake("j", max_staleness=2)
    intake.offer(traj("g1", 0))
    intake.offer(traj("g1", 1))
    batch, _ = intake.take_batch(0, 1)
    # The step is under way: the copy, made with newer weights, arrives.
    assert intake.offer(traj("g1", 0, version=1)) == ("committed", "in the step under way")
    assert intake.offer(traj("g1", 1, version=1))[0] == "committed"
    intake.mark_trained(batch)
    assert intake.take_batch(1, 1) == ([], [])
    assert intake.offer(traj("g1", 0, version=1)) == ("committed", "already trained")
    assert not intake.training


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


def test_only_the_latest_stale_drops_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake_module, "DROPPED_REMEMBERED", 3)
    intake = Intake("j", max_staleness=0)
    for n in range(5):
        for i in range(2):
            intake.offer(traj(f"old{n}", i, version=0))
        intake.take_batch(5, 1)
    assert list(intake.dropped_groups) == ["old2", "old3", "old4"]
    assert intake.offer(traj("old4", 0))[0] == "rejected"
    assert intake.offer(traj("old0", 0))[0] == "received"  # forgotten: stale again below
    intake.offer(traj("old0", 1))
    assert [g.group_id for g, _ in intake.take_batch(5, 1)[1]] == ["old0"]


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


def test_a_trajectory_id_must_name_its_group() -> None:
    intake = Intake("j", max_staleness=1)
    forged = traj("g1", 0)
    forged.trajectory_id = "g2/0"

    verdict, why = intake.offer(forged)

    assert verdict == "rejected" and "<group_id>/<n>" in why and not intake.groups


def test_trained_groups_stay_runs_however_many_are_trained() -> None:
    trained = TrainedGroups()
    order = [*range(0, 500), *range(501, 1000), 500]  # 500 arrives last, out of order
    for index in order:
        trained.add(group_id("job-a", index))
    trained.add("free-form")
    trained.add(group_id("job-a", 3))  # again: no change

    assert len(trained) == 1001
    assert trained.to_json() == {"runs": {"job-a-g": [[0, 1000]]}, "others": ["free-form"]}
    assert group_id("job-a", 999) in trained and group_id("job-a", 1000) not in trained
    assert "job-a-g0000003" not in trained  # another spelling is another id
    assert "free-form" in trained and "other" not in trained


def test_trained_groups_survive_a_checkpoint_in_either_format() -> None:
    trained = TrainedGroups()
    for index in (7, 3, 4, 9):
        trained.add(group_id("j", index))
    stored = json.loads(json.dumps(trained.to_json()))

    for restored in (
        TrainedGroups.from_json(stored),
        TrainedGroups.from_json(["j-g000003", "j-g000004", "j-g000007", "j-g000009"]),
    ):
        assert restored.to_json() == {"runs": {"j-g": [[3, 5], [7, 8], [9, 10]]}, "others": []}
        assert len(restored) == 4


def test_a_restored_intake_still_refuses_what_was_trained() -> None:
    intake = Intake("j", max_staleness=1)
    for i in range(2):
        intake.offer(traj("j-g000001", i))
    batch, _ = intake.take_batch(0, 1)
    intake.mark_trained(batch)
    restored = Intake("j", max_staleness=1)
    restored.trained_groups = TrainedGroups.from_json(
        json.loads(json.dumps(intake.trained_groups.to_json()))
    )

    assert restored.offer(traj("j-g000001", 0)) == ("committed", "already trained")
    assert restored.offer(traj("j-g000002", 0)) == ("received", "")


def test_a_group_made_with_lost_weights_is_refused_and_asked_for_again_once() -> None:
    intake = Intake("j", max_staleness=2)
    intake.restored_step = 8
    for i in range(2):
        verdict, why = intake.offer(traj("j-g000005", i, version=9))
        assert verdict == "rejected" and "lost when the trainer was restored" in why
    assert intake.offer(traj("j-g000006", 0, version=8)) == ("received", "")

    assert list(intake.take_regenerate()) == ["j-g000005"]
    assert intake.take_regenerate() == {}
