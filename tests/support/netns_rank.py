"""`python -m tests.support.netns_rank`: one FSDP2 trainer rank of a two-rank group whose ranks
live on different hosts (tests/e2e/test_ranks_across_hosts.py runs each in its own network
namespace). Over the network between them: the rendezvous and the collectives of two steps, a
sharded checkpoint into the folder both see, the whole weights gathered on rank 0, which
publishes them as weight version 1 over UCX (etcd runs on rank 0's host), and rank 1 pulls that
version from rank 0 and writes what it got beside the checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from robustrl.contracts.keys import KeySpace
from robustrl.core.config import EtcdSettings
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.heartbeat import Progress
from robustrl.weights.ucx.transport import UcxTransport
from services.trainer.grpo import GRPOConfig, GRPOTrainer, Sample
from services.trainer.ranks import (
    RankGroup,
    SaveOrder,
    StepOrder,
    run_step,
    save_rank,
    start_sharded,
)
from services.trainer.ranks.sharding import shard_model

JOB = "hosts"


def batch(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(step)
    return [
        Sample(
            torch.randint(4, 16, (5,), generator=gen).tolist(),
            torch.randint(4, 16, (3,), generator=gen).tolist(),
            [-2.0, -2.0, -2.0],
            float(torch.randn((), generator=gen)),
        )
        for _ in range(6)
    ]


async def weights(args: argparse.Namespace, full: dict[str, torch.Tensor]) -> None:
    """Rank 0 publishes `full` as version 1; rank 1 pulls it and saves what it got."""
    settings = EtcdSettings(endpoints=args.etcd, prefix="/netns")
    deadline = time.monotonic() + 60
    while True:
        try:
            client = await connect_etcd(settings)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    keys = KeySpace(settings.prefix)
    transport = UcxTransport(
        client, keys, JOB, instance_id=f"rank{args.rank}", epoch=1, host=args.host
    )
    try:
        await transport.start()
        if args.rank == 0:
            await transport.publish(1, [(name, t) for name, t in full.items()])
            while not (args.dir / "pulled.pt").exists():  # noqa: ASYNC110 - serve until rank 1 has it
                await asyncio.sleep(0.1)
        else:
            while await transport.latest_version() != 1:  # noqa: ASYNC110 - etcd is polled
                await asyncio.sleep(0.1)
            pulled = await transport.pull(JOB, 1)
            torch.save({k: v.clone() for k, v in pulled}, args.dir / "pulled.tmp")
            (args.dir / "pulled.tmp").rename(args.dir / "pulled.pt")
    finally:
        await transport.close()
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True, help="rank 0's address:port")
    parser.add_argument("--host", required=True, help="this host's address")
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="the folder both hosts see")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    whole = model.state_dict()
    group = RankGroup(
        args.rank, 2, args.master, Progress(), timeout_s=60, sharded=True, address=args.host
    )
    group.init()
    try:
        trainer = GRPOTrainer(shard_model(model), GRPOConfig(lr=1e-2), pad_id=0)
        start_sharded(group, trainer, "", whole if args.rank == 0 else {})
        for step in range(2):
            run_step(group, trainer, StepOrder(step, batch(step)))
        save_rank(group, trainer, SaveOrder(2, str(args.dir / "checkpoint")), None).result()
        full = group.gather_weights(trainer.model)
        if args.rank == 0:
            torch.save(full, args.dir / "full.pt")
        dist.barrier()  # the checkpoint and full.pt are written
    finally:
        group.close()
    asyncio.run(weights(args, full))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
