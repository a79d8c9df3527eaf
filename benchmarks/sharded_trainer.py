"""Trainer ranks on the CPU, side by side: step time, what each rank holds, and sharded
checkpoints written at one world size and restored at another.

Four runs on one generated model and the same batches: one rank alone (a whole model, no
process group), two ddp ranks (whole copies, one all-reduce), one fsdp rank and two fsdp ranks
(FSDP2 shards, `services/trainer/ranks/sharding.py`). Each rank is its own process with
`--threads` torch threads; every rank of a run trains its strided shard of the same batch.
Printed per run: the median step time (after `--warmup` steps), the ratio to the lone rank,
the parameter and AdamW bytes each rank holds, each rank's peak RSS. The fsdp runs also write a
sharded checkpoint (the time the step waits for: the copy off the model; and the time until
every rank's part is on disk), and each restores the other's checkpoint: written by 2 ranks
and read by 1 (and into a whole model, with no process group), written by 1 and read by 2;
the restored weights are compared bitwise with the ones written. They also publish a version
as the trainer does (every rank packs its share of the buckets from its shards), beside a whole
copy gathered on rank 0: the time and the bytes each leaves on a rank.

    python benchmarks/sharded_trainer.py                 # ~25M parameters, 2 threads a rank
    python benchmarks/sharded_trainer.py --layers 4 --steps 6
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from robustrl.cli.stack import free_port  # noqa: E402
from robustrl.core.heartbeat import Progress  # noqa: E402
from robustrl.core.logs import configure_logging  # noqa: E402
from robustrl.generation.modelgen import ModelShape, init_model  # noqa: E402
from robustrl.weights.checksums import bucket_checksum  # noqa: E402
from robustrl.weights.protocol import plan_layout  # noqa: E402
from robustrl.weights.ucx.buffers import pack_into  # noqa: E402
from services.trainer.grpo import GRPOConfig, GRPOTrainer, Sample  # noqa: E402
from services.trainer.ranks import (  # noqa: E402
    RankGroup,
    SaveOrder,
    StepOrder,
    local_numel,
    optimizer_numel,
    run_step,
    save_rank,
    start_sharded,
)
from services.trainer.ranks.sharding import load_sharded, shard_model  # noqa: E402
from services.trainer.ranks.shares import pack_share  # noqa: E402

RUNS = [("alone", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32, help="samples per step")
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens a sample")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return parser.parse_args(argv)


def batches(args: argparse.Namespace, vocab: int, seed: int) -> list[list[Sample]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(args.warmup + args.steps):
        step = []
        for _ in range(args.samples):
            prompt = torch.randint(4, vocab, (8,), generator=gen).tolist()
            completion = torch.randint(4, vocab, (args.tokens,), generator=gen).tolist()
            advantage = float(torch.randn((), generator=gen))
            step.append(Sample(prompt, completion, [-2.5] * len(completion), advantage))
        out.append(step)
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(model_dir: Path) -> GRPOTrainer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOTrainer(model, GRPOConfig(lr=1e-4), pad_id=0)


def rank_main(
    rank: int, strategy: str, world: int, master: str, args: argparse.Namespace, out: Path
) -> None:
    """One rank of one run; writes what it measured to out/<strategy><world>-rank<r>.json."""
    configure_logging(service="bench", instance=f"{strategy}{world}-rank{rank}", level="warning")
    torch.set_num_threads(args.threads)
    model_dir = out / "model"
    trainer = load(model_dir)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    steps = batches(args, int(vocab), seed=0)
    result: dict[str, Any] = {"rank": rank}
    group = None
    if strategy != "alone":
        group = RankGroup(
            rank, world, master, Progress(), timeout_s=600, sharded=strategy == "fsdp"
        )
        group.init()
    try:
        if group is not None and group.sharded:
            whole = trainer.model.state_dict()
            trainer = GRPOTrainer(shard_model(trainer.model), trainer.config, pad_id=0)
            start_sharded(group, trainer, "", whole if rank == 0 else {})
            del whole
        elif group is not None:
            group.broadcast_state(trainer.model, trainer.optimizer)
        times = []
        for i, batch in enumerate(steps):
            started = time.perf_counter()
            if group is None:
                trainer.step(batch)
            else:
                run_step(group, trainer, StepOrder(i, batch))
            if i >= args.warmup:
                times.append(time.perf_counter() - started)
        result["step_s"] = statistics.median(times)
        result["param_bytes"] = 4 * local_numel(trainer.model.parameters())
        result["optimizer_bytes"] = 4 * optimizer_numel(trainer.optimizer)
        if group is not None and group.sharded:
            result.update(publish_from_shards(group, trainer))
            result.update(checkpoint_and_restore(group, trainer, world, out))
        result["peak_rss_mib"] = peak_rss_mib()
    finally:
        if group is not None:
            group.close()
    (out / f"{strategy}{world}-rank{rank}.json").write_text(json.dumps(result))


def publish_from_shards(
    group: RankGroup, trainer: GRPOTrainer, repeats: int = 3
) -> dict[str, float]:
    """What publishing a version costs each rank: packing its share of the buckets from the
    shards, checked finite and hashed (what the trainer does), beside gathering a whole copy
    on rank 0 and checking, packing and hashing it there (what it did); the median of
    `repeats`, and the bytes of the version each way leaves on a rank (the whole way also kept
    the gathered copy)."""

    def take(nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    shares, wholes = [], []
    share_bytes, whole_bytes = 0, 0
    for _ in range(repeats):
        started = time.perf_counter()
        packed = pack_share(
            trainer.model,
            rank=group.rank,
            world_size=group.world_size,
            bucket_bytes=32 << 20,
            algorithm="xxh3_128",
            take_buffer=take,
        )
        shares.append(time.perf_counter() - started)
        share_bytes = packed.share.buffer.numel()
        del packed
        started = time.perf_counter()
        full = group.gather_weights(trainer.model)
        if full:  # rank 0 then checks, packs and hashes the whole copy, as its publish did
            tensors = list(full.items())
            assert all(bool(torch.isfinite(t).all()) for _, t in tensors)
            entries, total, spans = plan_layout(tensors, 32 << 20)
            whole = take(total, torch.device("cpu"))
            pack_into(tensors, entries, whole)
            for offset, nbytes in spans:
                bucket_checksum(whole[offset : offset + nbytes], "xxh3_128")
            whole_bytes = total
            del whole, tensors
        wholes.append(time.perf_counter() - started)
        del full
    return {
        "share_pack_s": statistics.median(shares),
        "share_bytes": float(share_bytes),
        "whole_gather_s": statistics.median(wholes),
        "whole_bytes": float(whole_bytes),
    }


def checkpoint_and_restore(
    group: RankGroup, trainer: GRPOTrainer, world: int, out: Path
) -> dict[str, float]:
    """Write this world's sharded checkpoint; restore the one the other fsdp run wrote (the
    1-rank run goes first and writes only; the 2-rank run reads it back, then the driver reads
    the 2-rank one alone)."""
    measured: dict[str, float] = {}
    path = out / f"ckpt-{world}"
    started = time.perf_counter()
    written = save_rank(group, trainer, SaveOrder(0, str(path)), None)
    measured["checkpoint_stage_s"] = time.perf_counter() - started
    written.result()
    measured["checkpoint_write_s"] = time.perf_counter() - started
    full = group.gather_weights(trainer.model)
    if group.rank == 0:
        torch.save(full, out / f"weights-{world}.pt")
    if world == 2:
        fresh = load(out / "model")
        fresh = GRPOTrainer(shard_model(fresh.model), fresh.config, pad_id=0)
        started = time.perf_counter()
        start_sharded(group, fresh, str(out / "ckpt-1"), {})
        measured["restore_s"] = time.perf_counter() - started
        restored = group.gather_weights(fresh.model)
        if group.rank == 0:
            wrote = torch.load(out / "weights-1.pt")
            measured["restore_bitwise"] = float(
                all(torch.equal(restored[k], v) for k, v in wrote.items())
            )
    return measured


def run(strategy: str, world: int, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    master = f"127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=rank_main, args=(r, strategy, world, master, args, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{strategy} x{world}: exit codes {[p.exitcode for p in procs]}")
    return [json.loads((out / f"{strategy}{world}-rank{r}.json").read_text()) for r in range(world)]


def restore_alone(out: Path) -> tuple[float, bool]:
    """The 2-rank checkpoint into one whole model, no process group: seconds, bitwise."""
    trainer = load(out / "model")
    started = time.perf_counter()
    load_sharded(trainer.model, trainer.optimizer, out / "ckpt-2", alone=True)
    took = time.perf_counter() - started
    wrote = torch.load(out / "weights-2.pt")
    state = trainer.model.state_dict()
    return took, all(torch.equal(state[k], v) for k, v in wrote.items())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sharded-bench-") as tmp:
        out = Path(tmp)
        shape = ModelShape(
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=128,
        )
        init_model(out / "model", seed=0, shape=shape)
        params = sum(p.numel() for p in load(out / "model").model.parameters())
        print(
            f"model: {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB fp32), "
            f"{args.samples} samples x {args.tokens} tokens a step, {args.threads} thread(s) "
            f"a rank, median of {args.steps} steps after {args.warmup}"
        )
        results = {(s, w): run(s, w, args, out) for s, w in RUNS}
        base = results[("alone", 1)][0]["step_s"]
        print(
            f"{'run':<9} | {'step s':>7} | {'x alone':>7} | {'params MiB/rank':>15} | "
            f"{'AdamW MiB/rank':>14} | {'peak RSS MiB/rank':>17}"
        )
        for (strategy, world), ranks in results.items():
            step = max(r["step_s"] for r in ranks)
            held = "/".join(f"{r['param_bytes'] / 2**20:.0f}" for r in ranks)
            adam = "/".join(f"{r['optimizer_bytes'] / 2**20:.0f}" for r in ranks)
            rss = "/".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
            print(
                f"{strategy + ' x' + str(world):<9} | {step:7.3f} | {base / step:6.2f}x | "
                f"{held:>15} | {adam:>14} | {rss:>17}"
            )
        for world in (1, 2):
            ranks = results[("fsdp", world)]
            print(
                f"publish fsdp x{world}: each rank packs its share in "
                + "/".join(f"{r['share_pack_s']:.3f}" for r in ranks)
                + " s and holds "
                + "/".join(f"{r['share_bytes'] / 2**20:.0f}" for r in ranks)
                + " MiB of the version; gathering a whole copy on rank 0 and packing it there "
                + f"took {ranks[0]['whole_gather_s']:.3f} s and "
                + f"{ranks[0]['whole_bytes'] / 2**20:.0f} MiB (beside the gathered copy)"
            )
        for world in (1, 2):
            r0 = results[("fsdp", world)][0]
            print(
                f"sharded checkpoint by {world} rank(s): the step waits "
                f"{r0['checkpoint_stage_s']:.3f} s (copy off the model), every part on disk "
                f"after {r0['checkpoint_write_s']:.3f} s"
            )
        two = results[("fsdp", 2)][0]
        print(
            f"restore written by 1, read by 2 ranks: {two['restore_s']:.3f} s, "
            f"bitwise equal: {bool(two['restore_bitwise'])}"
        )
        took, same = restore_alone(out)
        print(f"restore written by 2, read by 1 (whole model): {took:.3f} s, bitwise equal: {same}")
        ok = bool(two["restore_bitwise"]) and same
        half = all(
            abs(r["param_bytes"] - 2 * params) <= 0.05 * 4 * params for r in results[("fsdp", 2)]
        )
        print(
            f"verdicts: restores bitwise {'ok' if ok else 'FAILED'}, "
            f"fsdp x2 ranks hold half each {'ok' if half else 'FAILED'}"
        )
        return 0 if ok and half else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
