"""Trainer ranks on gloo (NCCL for CUDA tensors), and the watchdog around their collectives.

Every rank is a trainer member of its own, started on its own on any host; the leader binds N
free trainers to a job of `trainer.world_size: N` with their ranks. Rank 0 (the trainer worker)
opens the group's store and publishes where it is in etcd for its epoch (`rendezvous.py`); the
others wait for that record and join (`services/trainer/follower.py`). Each step, rank 0
broadcasts the whole batch, and each rank trains its `shard`. The loss is divided by the
*batch's* token count, so the shards' gradients sum to the single-rank gradient. One flattened
all-reduce sums them (with a non-finite flag), so every rank applies the same update to the
same parameters. Per step, on every rank (`step.py`'s `run_step`):

    broadcast_batch -> forward_backward (own shard) -> sync_gradients -> optimizer
    -> gather_step (metrics and a parameter fingerprint, to catch diverged ranks)

FSDP2 ranks (`sharding.py`) run the step as one watched collective instead, and hold 1/N of
the parameters, gradients and optimizer state each. After the start and each step every FSDP2
rank packs its share of the weights as the next version (`shares.py`): rank 0 publishes the
manifest, and each rank serves its own range of buckets. An evaluation is an order too: every
rank generates with its shards, and rank 0 scores.

The watchdog (`group.py`): every collective goes through `RankGroup.collective`. It numbers
the collective (counter `collective_seq`; every rank runs the same collectives in the same
order, so the numbers line up across ranks) and reports phase `collective`, with its start
time, while inside. The monitor's `collective_hangs` (services/monitor/progress_detectors.py)
then names the rank whose `collective_seq` is below the number the other ranks have waited in
past the budget. A thread on each rank also logs `trainer.collective_waiting`, naming the
collective, once a wait passes `warn_after`.

A rank waiting for rank 0's next batch is idle, not hung: rank 0 may be evaluating,
checkpointing or waiting for data for minutes. So it waits outside gloo, on a key in the
rendezvous store that rank 0 sets just before it broadcasts, in phase `waiting_data` with
no timeout. The broadcast itself is then an ordinary collective on every rank. A rank
stopped while it waits has not entered the broadcast rank 0 is waiting in, so it is named
too.

Rank 0 runs its side from a thread, because every call blocks (`leader.py`):

    ranks = LeaderRanks(runtime.progress, world_size=W, host=advertise_host, epoch=epoch)
    master = ranks.listen()            # then published: rendezvous.publish(...)
    ranks.start(trainer, restore_from=sharded_checkpoint_or_None, step=steps_done)
    metrics = ranks.step(trainer, samples, step=s)  # instead of trainer.step(samples)
    ranks.share                        # FSDP2: rank 0's share of the weights, to publish
    ranks.evaluate(generate)           # FSDP2: every rank generates with its shards
    ranks.close()  # the other ranks' work is done; the leader releases them

`start` goes after any checkpoint restore: it broadcasts rank 0's parameters and optimizer
state (FSDP2 ranks read their parts of the sharded checkpoint), so every rank starts
identical.
"""

from services.trainer.ranks import rendezvous
from services.trainer.ranks.group import IDLE_WAIT, RankGroup, WrongGroup
from services.trainer.ranks.leader import (
    GroupBroken,
    LeaderRanks,
    RanksDiverged,
    evaluate_rank,
    save_rank,
    start_sharded,
)
from services.trainer.ranks.sharding import (
    gather_full,
    local_numel,
    optimizer_numel,
    report_held,
)
from services.trainer.ranks.shares import PackedShare, ShareSettings, pack_group_share
from services.trainer.ranks.step import (
    EvalOrder,
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
    "EvalOrder",
    "GroupBroken",
    "LeaderRanks",
    "Order",
    "PackedShare",
    "RankGroup",
    "RanksDiverged",
    "SaveOrder",
    "ShareSettings",
    "StepOrder",
    "StepOutcome",
    "WrongGroup",
    "evaluate_rank",
    "fingerprint",
    "gather_full",
    "local_numel",
    "optimizer_numel",
    "pack_group_share",
    "rendezvous",
    "report_held",
    "run_step",
    "save_rank",
    "shard",
    "start_sharded",
]
