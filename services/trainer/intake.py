"""Trajectories in, groups out: de-duplication, group assembly and the staleness bound.

Pure bookkeeping (no torch, no gRPC), so the rules are tested on their own:
- a trajectory id is trained at most once, ever (the trained set is checkpointed);
- a group is ready when it holds `group_size` distinct trajectories;
- a group generated with weight version v may train step s only if s - v <= k; older
  groups are dropped and reported, never trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from robustrl.v1 import trainer_pb2


@dataclass
class Group:
    group_id: str
    size: int
    trajectories: dict[str, trainer_pb2.Trajectory] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.size

    @property
    def version(self) -> int:
        """The oldest weight version any of its trajectories was generated with."""
        return min(t.weight_version for t in self.trajectories.values())


@dataclass
class Intake:
    job_id: str
    max_staleness: int
    groups: dict[str, Group] = field(default_factory=dict)
    trained_ids: set[str] = field(default_factory=set)
    trained_groups: set[str] = field(default_factory=set)
    dropped_groups: dict[str, str] = field(default_factory=dict)
    restored_step: int | None = None
    """Set after a restore until the first new step: trajectories made with a higher weight
    version came from weights that were lost with the failed trainer."""

    def offer(self, trajectory: trainer_pb2.Trajectory) -> tuple[str, str]:
        """('received' | 'committed' | 'rejected', reason) for one incoming trajectory."""
        tid = trajectory.trajectory_id
        if trajectory.job_id != self.job_id:
            return (
                "rejected",
                f"trajectory of job {trajectory.job_id}, this trainer runs {self.job_id}",
            )
        if not tid or not trajectory.group_id or trajectory.group_size < 1:
            return "rejected", "a trajectory needs an id, a group id and a group size"
        if (
            len(trajectory.logprobs) != len(trajectory.completion_ids)
            or not trajectory.completion_ids
        ):
            return "rejected", "completion ids and logprobs must be non-empty and of equal length"
        if tid in self.trained_ids or trajectory.group_id in self.trained_groups:
            return "committed", "already trained"
        if self.restored_step is not None and trajectory.weight_version > self.restored_step:
            return "rejected", (
                f"made with weight version {trajectory.weight_version}, lost when the trainer "
                f"was restored to step {self.restored_step}"
            )
        if trajectory.group_id in self.dropped_groups:
            return "rejected", self.dropped_groups[trajectory.group_id]
        group = self.groups.setdefault(
            trajectory.group_id, Group(trajectory.group_id, trajectory.group_size)
        )
        group.trajectories.setdefault(tid, trajectory)  # a re-send keeps the first copy
        return "received", ""

    def take_batch(
        self, step: int, groups_per_step: int
    ) -> tuple[list[Group], list[tuple[Group, str]]]:
        """groups_per_step ready groups fit for `step`, oldest first (or none if there are
        fewer), and the groups dropped as too stale for it, with why."""
        dropped: list[tuple[Group, str]] = []
        batch: list[Group] = []
        for group in list(self.groups.values()):
            if not group.complete:
                continue
            if step - group.version > self.max_staleness:
                why = (
                    f"stale: generated with weight version {group.version}, too old for step "
                    f"{step} (bound {self.max_staleness})"
                )
                dropped.append((group, why))
                self.dropped_groups[group.group_id] = why
                del self.groups[group.group_id]
            elif len(batch) < groups_per_step:
                batch.append(group)
        if len(batch) < groups_per_step:
            return [], dropped
        for group in batch:
            del self.groups[group.group_id]
        return batch, dropped

    def mark_trained(self, batch: list[Group]) -> None:
        self.restored_step = None
        for group in batch:
            self.trained_groups.add(group.group_id)
            self.trained_ids.update(group.trajectories)
