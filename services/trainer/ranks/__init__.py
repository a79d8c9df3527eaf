"""Data-parallel trainer ranks on gloo, and the watchdog around their collectives.

Rank 0 is the bound trainer. It starts ranks 1..N-1 as follower processes on its own host
(`python -m services.trainer.follower`, `followers.py`), and every rank registers and streams
its own heartbeat. Each step, rank 0 broadcasts the whole batch, and each rank trains on its
`shard`. The loss is divided by the *batch's* token count, so the shards' gradients sum to
the single-rank gradient. One flattened all-reduce sums them (with a non-finite flag), so
every rank applies the same update to the same parameters. Per step, on every rank
(`step.py`'s `run_step`):

    broadcast_batch -> forward_backward (own shard) -> sync_gradients -> optimizer
    -> gather_step (metrics and a parameter fingerprint, to catch diverged ranks)

The watchdog (`group.py`): every collective goes through `RankGroup.collective`. It numbers
the collective (counter `collective_seq`; every rank runs the same collectives in the same
order, so the numbers line up across ranks) and reports phase `collective`, with its start
time, while inside. The monitor's `collective_hangs` (services/monitor/progress_detectors.py)
then names the rank whose `collective_seq` is below the number the other ranks have waited in
past the budget. A thread on each rank also logs `trainer.collective_waiting`, naming the
collective, once a wait passes `warn_after`.

A follower waiting for rank 0's next batch is idle, not hung: rank 0 may be evaluating,
checkpointing or waiting for data for minutes. So it waits outside gloo, on a key in the
rendezvous store that rank 0 sets just before it broadcasts, in phase `waiting_data` with
no timeout. The broadcast itself is then an ordinary collective on every rank. A follower
stopped while it waits has not entered the broadcast rank 0 is waiting in, so it is named
too.

Rank 0 (the trainer worker) runs all of this from a thread, because every call blocks
(`leader.py`):

    ranks = LeaderRanks(runtime.progress, timeout_s=300)
    spec_path.write_text(spec.model_dump_json())
    ranks.start(trainer, spec_path=spec_path, job_id=job_id, world_size=W,
                etcd=runtime.etcd_settings, instance_id=runtime.instance_id,
                settings=runtime.settings, torch_threads=settings.torch_threads)
    metrics = ranks.step(trainer, samples, step=s)  # instead of trainer.step(samples)
    ranks.close()  # followers exit 0; those that do not are stopped by pid

`start` goes after any checkpoint restore: it broadcasts rank 0's parameters and optimizer
state, so every rank starts identical.
"""

from services.trainer.ranks.followers import (
    follower_instance_id,
    spawn_followers,
    stop_followers,
)
from services.trainer.ranks.group import IDLE_WAIT, RankGroup
from services.trainer.ranks.leader import (
    RANK_EXIT_GRACE,
    LeaderRanks,
    RankExited,
    RanksDiverged,
    save_rank,
    start_sharded,
)
from services.trainer.ranks.sharding import gather_full, local_numel, optimizer_numel
from services.trainer.ranks.step import (
    Order,
    SaveOrder,
    StepOrder,
    StepOutcome,
    fingerprint,
    run_step,
    shard,
)

__all__ = [
    "IDLE_WAIT",
    "RANK_EXIT_GRACE",
    "LeaderRanks",
    "Order",
    "RankExited",
    "RankGroup",
    "RanksDiverged",
    "SaveOrder",
    "StepOrder",
    "StepOutcome",
    "fingerprint",
    "follower_instance_id",
    "gather_full",
    "local_numel",
    "optimizer_numel",
    "run_step",
    "save_rank",
    "shard",
    "spawn_followers",
    "start_sharded",
    "stop_followers",
]
