"""Trajectories in, groups out: de-duplication, group assembly and the staleness bound.

Pure bookkeeping (no torch, no gRPC), so the rules are tested on their own:
- a trajectory id is trained at most once, ever: its id is `<group_id>/<n>`, a group is
  trained whole, and the set of trained groups is checkpointed (compactly: see TrainedGroups);
- a group is ready when it holds `group_size` distinct trajectories;
- a group generated with weight version v may train step s only if s - v <= k; older
  groups are dropped and reported, never trained.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from robustrl.contracts.ids import parse_group_id
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


class TrainedGroups:
    """The ids of every group trained so far, in space that grows with the gaps, not the job.

    It goes into every per-step checkpoint, so it must stay small rather than list every id
    (docs/decisions/0301-trained-groups-as-runs.md). Groups are numbered by the coordinator and
    trained nearly in order, so numbered ids (contracts.ids.group_id) are kept as runs
    [start, end) per job; the runs break only where a group was dropped or trained out of
    order. Other ids are listed as they are.
    """

    def __init__(self) -> None:
        self._runs: dict[str, list[list[int]]] = {}
        self._others: set[str] = set()

    def __len__(self) -> int:
        return len(self._others) + sum(
            end - start for runs in self._runs.values() for start, end in runs
        )

    def __contains__(self, group_id: object) -> bool:
        if not isinstance(group_id, str):
            return False
        numbered = _run_key(group_id)
        if numbered is None:
            return group_id in self._others
        runs = self._runs.get(numbered[0], [])
        at = bisect.bisect_right(runs, numbered[1], key=lambda run: run[0]) - 1
        return at >= 0 and numbered[1] < runs[at][1]

    def add(self, group_id: str) -> None:
        numbered = _run_key(group_id)
        if numbered is None:
            self._others.add(group_id)
            return
        prefix, index = numbered
        runs = self._runs.setdefault(prefix, [])
        at = bisect.bisect_right(runs, index, key=lambda run: run[0])
        if at > 0 and index < runs[at - 1][1]:
            return  # trained already
        joins_left = at > 0 and runs[at - 1][1] == index
        joins_right = at < len(runs) and runs[at][0] == index + 1
        if joins_left and joins_right:
            runs[at - 1][1] = runs[at][1]
            del runs[at]
        elif joins_left:
            runs[at - 1][1] = index + 1
        elif joins_right:
            runs[at][0] = index
        else:
            runs.insert(at, [index, index + 1])

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": {prefix: [list(run) for run in runs] for prefix, runs in self._runs.items()},
            "others": sorted(self._others),
        }

    @classmethod
    def from_json(cls, data: Any) -> TrainedGroups:
        """From to_json's output, or from a plain list of ids (checkpoints of earlier releases)."""
        out = cls()
        if isinstance(data, list):
            for group_id in data:
                out.add(str(group_id))
            return out
        for prefix, runs in dict(data.get("runs", {})).items():
            out._runs[str(prefix)] = [[int(start), int(end)] for start, end in runs]
        out._others = {str(group_id) for group_id in data.get("others", [])}
        return out


def _run_key(group_id: str) -> tuple[str, int] | None:
    """Where a numbered group's runs are kept ("<job_id>-g", as checkpoints store it) and its
    number; None for any other id."""
    numbered = parse_group_id(group_id)
    return None if numbered is None else (f"{numbered[0]}-g", numbered[1])


DROPPED_REMEMBERED = 100_000
"""Stale-dropped groups an intake remembers (about 100 bytes each)."""


@dataclass
class Intake:
    job_id: str
    max_staleness: int
    groups: dict[str, Group] = field(default_factory=dict)
    trained_groups: TrainedGroups = field(default_factory=TrainedGroups)
    dropped_groups: dict[str, str] = field(default_factory=dict)
    """The latest `DROPPED_REMEMBERED` groups dropped as stale, with why: their late
    trajectories are refused with it. Older ones are forgotten (a trainer must not grow with
    its job): a late trajectory of one starts a group that is dropped as stale again."""
    regenerate: dict[str, str] = field(default_factory=dict)
    """Groups refused because their trajectories were made with lost weights, with why: the
    coordinator must lease them again (until it hears of them, nothing else will)."""
    restored_step: int | None = None
    """Set after a restore until the first new step: trajectories made with a higher weight
    version came from weights that were lost with the failed trainer."""
    training: set[str] = field(default_factory=set)
    """Groups taken into the step under way (`take_batch`) and not marked trained yet. A copy
    of one arriving meanwhile (a lost rollout had sent it, then its requeued lease was made
    again) is not a new group: trained after this step, it would be trained twice."""

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
        if not tid.startswith(f"{trajectory.group_id}/"):
            return "rejected", (
                f"trajectory id {tid!r} is not <group_id>/<n> for group {trajectory.group_id!r}"
            )
        if (
            len(trajectory.logprobs) != len(trajectory.completion_ids)
            or not trajectory.completion_ids
        ):
            return "rejected", "completion ids and logprobs must be non-empty and of equal length"
        if trajectory.group_id in self.trained_groups:
            return "committed", "already trained"
        if trajectory.group_id in self.training:
            return "committed", "in the step under way"
        if self.restored_step is not None and trajectory.weight_version > self.restored_step:
            why = (
                f"made with weight version {trajectory.weight_version}, lost when the trainer "
                f"was restored to step {self.restored_step}"
            )
            self.regenerate.setdefault(trajectory.group_id, why)
            return "rejected", why
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
                if len(self.dropped_groups) > DROPPED_REMEMBERED:
                    del self.dropped_groups[next(iter(self.dropped_groups))]
                del self.groups[group.group_id]
            elif len(batch) < groups_per_step:
                batch.append(group)
        if len(batch) < groups_per_step:
            return [], dropped
        for group in batch:
            del self.groups[group.group_id]
            self.training.add(group.group_id)
        return batch, dropped

    def take_regenerate(self) -> dict[str, str]:
        """The groups to have generated again since the last call (see `regenerate`)."""
        taken, self.regenerate = self.regenerate, {}
        return taken

    def mark_trained(self, batch: list[Group]) -> None:
        self.restored_step = None
        for group in batch:
            self.trained_groups.add(group.group_id)
            self.training.discard(group.group_id)
