"""What a trainer tells each rollout on its trajectory streams after the first ack: which of
its trajectories were dropped, and which are committed. A rollout keeps every trajectory
until then; a trajectory is committed once the step that trained it is in a durable
checkpoint, so a restored trainer never needs one the rollout has let go of."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

from robustrl.core.logs import get_logger
from robustrl.v1 import trainer_pb2
from services.trainer.intake import Group

log = get_logger(__name__)


class RolloutAcks:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.outboxes: dict[str, list[asyncio.Queue[trainer_pb2.TrajectoryAck]]] = defaultdict(list)
        """The open streams' outboxes, by rollout instance."""
        self.uncommitted: dict[str, list[str]] = defaultdict(list)
        """Trajectory ids trained since the last checkpoint, by rollout."""
        self.pending: dict[int, dict[str, list[str]]] = {}
        """Trained trajectory ids per step, by rollout, until that step's checkpoint is durable."""

    def subscribe(self, rollout: str) -> asyncio.Queue[trainer_pb2.TrajectoryAck]:
        queue: asyncio.Queue[trainer_pb2.TrajectoryAck] = asyncio.Queue()
        self.outboxes[rollout].append(queue)
        return queue

    def unsubscribe(self, rollout: str, queue: asyncio.Queue[trainer_pb2.TrajectoryAck]) -> None:
        with contextlib.suppress(ValueError):
            self.outboxes[rollout].remove(queue)

    def tell(self, rollout: str, ack: trainer_pb2.TrajectoryAck) -> None:
        for queue in self.outboxes.get(rollout, []):
            queue.put_nowait(ack)

    def reject(self, stale: list[tuple[Group, str]]) -> dict[str, str]:
        """Tell each rollout which of its trajectories were dropped, so it stops keeping them."""
        for group, why in stale:
            log.info("trainer.group_dropped", job=self.job_id, group=group.group_id, reason=why)
            for traj in group.trajectories.values():
                ack = trainer_pb2.TrajectoryAck()
                ack.rejected[traj.trajectory_id] = why
                self.tell(traj.rollout_instance_id, ack)
        return {group.group_id: why for group, why in stale}

    def trained(self, batch: list[Group]) -> None:
        """The batch's trajectories were trained: committed with the next durable checkpoint."""
        for group in batch:
            for traj in group.trajectories.values():
                self.uncommitted[traj.rollout_instance_id].append(traj.trajectory_id)

    def checkpointing(self, step: int) -> None:
        """The checkpoint of `step` is being written: what was trained so far waits for it."""
        self.pending[step] = dict(self.uncommitted)
        self.uncommitted.clear()

    def commit_through(self, step: int) -> None:
        """Everything trained up to `step` is in a durable checkpoint: rollouts may drop it."""
        for done in sorted(s for s in self.pending if s <= step):
            for rollout, ids in self.pending.pop(done).items():
                self.tell(rollout, trainer_pb2.TrajectoryAck(committed_ids=ids))
