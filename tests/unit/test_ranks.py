"""Data-parallel ranks: sharding, the collective watchdog's signals, and two real gloo ranks
whose step equals the single-rank step on the same samples."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from robustrl.cli.stack import free_port
from robustrl.core.heartbeat import Progress
from robustrl.weights.checksums import bucket_checksum
from robustrl.weights.protocol import plan_layout
from robustrl.weights.ucx.buffers import pack_into
from services.trainer.grpo import GRPOConfig, GRPOTrainer, Sample, completion_logprobs
from services.trainer.ranks import (
    RankGroup,
    SaveOrder,
    StepOrder,
    fingerprint,
    local_numel,
    optimizer_numel,
    run_step,
    save_rank,
    shard,
    start_sharded,
)
from services.trainer.ranks.sharding import load_sharded, shard_model
from services.trainer.ranks.shares import pack_share

PAD = 0
CONFIG = GRPOConfig(lr=1e-2)


def test_shard_is_a_deterministic_split_of_the_whole_batch() -> None:
    samples = list(range(7))
    parts = [shard(samples, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(x for part in parts for x in part) == samples
    assert shard([0], 1, 2) == []  # fewer samples than ranks: an empty shard
    with pytest.raises(ValueError):
        shard(samples, 2, 2)


def test_a_collective_is_numbered_and_reported_then_the_phase_comes_back() -> None:
    progress = Progress(phase="forward_backward")
    group = RankGroup(1, 2, "127.0.0.1:1", progress, timeout_s=5)
    assert progress.counters == {"collective_seq": 0.0} and progress.rank == 1
    with group.collective("sync_gradients") as seq:
        assert seq == 1
        assert progress.phase == "collective"
        assert progress.counters["collective_seq"] == 1.0
        entered = progress.phase_started_at
    assert progress.phase == "forward_backward"
    assert progress.phase_started_at >= entered  # the phase restarts after the wait
    with pytest.raises(RuntimeError), group.collective("gather_step"):
        raise RuntimeError("Connection reset by peer")
    assert group.broken
    assert progress.phase == "forward_backward"
    assert progress.counters["collective_seq"] == 2.0  # it was entered: that is what counts
    group.close()
    assert "collective_seq" not in progress.counters


def test_a_new_counter_replaces_the_dict_rather_than_growing_it() -> None:
    progress = Progress(counters={"step": 1.0})
    seen = progress.counters
    progress.set_counter("step", 2.0)
    assert progress.counters is seen and seen["step"] == 2.0
    progress.set_counter("nonfinite_loss", 1.0)
    assert progress.counters is not seen and "nonfinite_loss" not in seen
    assert progress.counters == {"step": 2.0, "nonfinite_loss": 1.0}


# --- two real gloo ranks against one ----------------------------------------------------------


def _trainer(tiny_model_dir: Path) -> GRPOTrainer:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return GRPOTrainer(model, CONFIG, pad_id=PAD)


def _batches(trainer: GRPOTrainer) -> tuple[list[Sample], list[list[Sample]]]:
    """A step rank 0 takes alone first (its state as after a restore), then the batches."""

    def sample(prompt: list[int], completion: list[int], adv: float) -> Sample:
        probe = Sample(prompt, completion, [0.0] * len(completion), 0.0)
        [lp] = completion_logprobs(trainer.model, [probe], PAD, 1.0)
        return Sample(prompt, completion, lp, adv)

    prompts = [[1, 5, 4, 6, 16], [1, 7, 4, 8, 16], [1, 9, 4, 9, 16], [1, 6, 4, 7, 16]]
    completions = [[7, 2], [8, 9, 2], [10], [11, 12, 13, 2]]
    s = [
        sample(p, c, a)
        for p, c, a in zip(prompts, completions, [1.0, -0.5, 0.8, -1.3], strict=True)
    ]
    poisoned = Sample(s[1].prompt_ids, s[1].completion_ids, s[1].behaviour_logprobs, math.nan)
    return [s[3], s[0]], [
        [s[0], s[1], s[2]],  # uneven shards: rank 0 gets two, rank 1 one
        [s[2]],  # rank 1's shard is empty
        [s[0], poisoned, s[2]],  # NaN on rank 1 only: every rank must skip the step
        [s[3], s[2], s[1], s[0]],
    ]


def _rank_main(
    rank: int, master: str, tiny_model_dir: Path, out: Path, check: Callable[[], None] | None = None
) -> None:
    torch.set_num_threads(1)
    trainer = _trainer(tiny_model_dir)
    before, batches = _batches(trainer)
    if rank == 0:
        trainer.step(before)
    else:
        with torch.no_grad():  # rank 1 starts elsewhere; the broadcast must fix that
            for p in trainer.model.parameters():
                p.add_(0.1)
    group = RankGroup(rank, 2, master, Progress(), timeout_s=30)
    group.init(check)
    try:
        group.broadcast_state(trainer.model, trainer.optimizer)
        results: list[dict[str, Any]] = []
        for step, batch in enumerate(batches):
            outcome = run_step(group, trainer, StepOrder(step, batch))
            results.append({"metrics": outcome.metrics, "fingerprints": outcome.fingerprints})
        torch.save(
            {
                "state": trainer.model.state_dict(),
                "steps_taken": trainer.steps_taken,
                "results": results,
                "seq": group.progress.counters["collective_seq"],
            },
            out / f"rank{rank}.pt",
        )
    finally:
        group.close()


def _two_ranks(main: Callable[..., None], *args: object) -> None:
    """`main(1, *args)` in a spawned process and `main(0, *args, check)` in this one (a second
    child would cost its imports); `check` fails rank 0's wait for rank 1 once it has exited."""
    peer = mp.get_context("spawn").Process(target=main, args=(1, *args))
    peer.start()

    def peer_alive() -> None:
        assert peer.exitcode is None, f"rank 1 exited with {peer.exitcode}"

    try:
        main(0, *args, peer_alive)
        peer.join(30)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()


@pytest.mark.timeout(90)
def test_two_gloo_ranks_take_the_single_rank_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    _two_ranks(_rank_main, f"127.0.0.1:{free_port()}", tiny_model_dir, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    single = _trainer(tiny_model_dir)
    before, batches = _batches(single)
    single.step(before)
    expected = [single.step(batch) for batch in batches]

    for got in ranks:
        for name, value in single.model.state_dict().items():
            assert torch.allclose(got["state"][name], value, atol=1e-6, rtol=0), name
        assert got["steps_taken"] == single.steps_taken == 4  # the NaN step was skipped
        for step, (result, want) in enumerate(zip(got["results"], expected, strict=True)):
            m = result["metrics"]
            assert m.nonfinite == want.nonfinite and m.stepped == want.stepped, step
            assert (m.num_tokens, m.num_samples) == (want.num_tokens, want.num_samples)
            if want.stepped:
                assert m.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
                assert m.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
                assert m.ratio_mean == pytest.approx(want.ratio_mean, rel=1e-6)
                assert m.clip_frac == pytest.approx(want.clip_frac, abs=1e-9)
            assert result["fingerprints"][0] == result["fingerprints"][1], step
    # Each rank names only its own NaN.
    assert ranks[1]["results"][2]["metrics"].nonfinite_where == "loss"
    assert ranks[0]["results"][2]["metrics"].nonfinite_where == ""
    # Same collectives in the same order: the numbers line up (1 state + 2 per step).
    assert ranks[0]["seq"] == ranks[1]["seq"] == 1 + 2 * len(batches)
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), name
    assert fingerprint(single.model) == pytest.approx(ranks[0]["results"][-1]["fingerprints"][0])


# --- FSDP2 ranks: the same step, half the state each, checkpoints across world sizes ----------


def _fsdp_rank_main(
    rank: int,
    world_size: int,
    master: str,
    tiny_model_dir: Path,
    out: Path,
    check: Callable[[], None] | None = None,
) -> None:
    """An FSDP2 group of `world_size`: world 1 takes the first step alone and writes a sharded
    checkpoint; world 2 starts from it, trains the batches and writes its own."""
    torch.set_num_threads(1)
    group = RankGroup(rank, world_size, master, Progress(), timeout_s=30, sharded=True)
    group.init(check)
    try:
        plain = _trainer(tiny_model_dir)
        before, batches = _batches(plain)
        trainer = GRPOTrainer(shard_model(_trainer(tiny_model_dir).model), CONFIG, pad_id=PAD)
        restore = str(out / "one") if world_size == 2 else ""
        start_sharded(group, trainer, restore, plain.model.state_dict())
        started = group.gather_weights(trainer.model)
        todo = [before] if world_size == 1 else batches
        results = [run_step(group, trainer, StepOrder(s, b)).metrics for s, b in enumerate(todo)]
        held = {
            "params": local_numel(trainer.model.parameters()),
            "optimizer": optimizer_numel(trainer.optimizer),
        }
        name = "one" if world_size == 1 else "two"
        save_rank(group, trainer, SaveOrder(len(todo), str(out / name)), None).result()
        full = group.gather_weights(trainer.model)
        torch.save(
            {"started": started, "full": full, "results": results, "held": held},
            out / f"{name}-rank{rank}.pt",
        )
    finally:
        group.close()


@pytest.mark.timeout(120)
def test_fsdp_ranks_take_the_single_rank_step_hold_half_and_restore_at_any_size(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # World 1: this process alone, the first step, a sharded checkpoint ("one").
    _fsdp_rank_main(0, 1, f"127.0.0.1:{free_port()}", tiny_model_dir, tmp_path)
    # World 2: this process and a spawned one, from "one", then the batches, then "two".
    _two_ranks(_fsdp_rank_main, 2, f"127.0.0.1:{free_port()}", tiny_model_dir, tmp_path)
    one = torch.load(tmp_path / "one-rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"two-rank{r}.pt", weights_only=False) for r in range(2)]

    # Written by 1 rank, read by 2: bitwise the weights world 1 ended with.
    for name, value in one["full"].items():
        assert torch.equal(ranks[0]["started"][name], value), name
    assert ranks[1]["full"] == {}  # only rank 0 holds the whole weights

    single = _trainer(tiny_model_dir)
    before, batches = _batches(single)
    single.step(before)
    expected = [single.step(batch) for batch in batches]
    for name, value in single.model.state_dict().items():
        assert torch.allclose(ranks[0]["full"][name], value, atol=1e-5, rtol=0), name
    for got in ranks:
        for step, (m, want) in enumerate(zip(got["results"], expected, strict=True)):
            assert m.nonfinite == want.nonfinite and m.stepped == want.stepped, step
            if want.stepped:  # the batch's metrics, summed over the ranks
                assert m.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
                assert m.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
                assert m.ratio_mean == pytest.approx(want.ratio_mean, rel=1e-5)
    # Each rank names only its own NaN (step 3: rank 1's shard holds it); both skipped it.
    assert [got["results"][2].nonfinite_where for got in ranks] == ["", "loss"]

    # Each rank holds about half of the parameters and of Adam's moments.
    total = sum(p.numel() for p in single.model.parameters())
    for got in ranks:
        assert abs(got["held"]["params"] - total / 2) <= total * 0.05, got["held"]
        assert abs(got["held"]["optimizer"] - total) <= total * 0.1, got["held"]
    assert sum(got["held"]["params"] for got in ranks) == total

    # Written by 2 ranks, read by 1 (a whole model, no process group): bitwise.
    alone = _trainer(tiny_model_dir)
    load_sharded(alone.model, alone.optimizer, tmp_path / "two", alone=True)
    for name, value in alone.model.state_dict().items():
        assert torch.equal(value, ranks[0]["full"][name]), name
    assert alone.steps_taken == single.steps_taken == 4


# --- publishing from the shards: each rank packs its range of buckets, nothing more -------


def _share_rank_main(
    rank: int,
    master: str,
    tiny_model_dir: Path,
    out: Path,
    check: Callable[[], None] | None = None,
) -> None:
    """Both ranks pack their shares of the sharded model, in buckets small enough that pieces
    of one tensor come from both ranks; then a NaN in rank 1's rows only."""
    torch.set_num_threads(1)
    group = RankGroup(rank, 2, master, Progress(), timeout_s=30, sharded=True)
    group.init(check)
    try:
        plain = _trainer(tiny_model_dir)
        trainer = GRPOTrainer(shard_model(_trainer(tiny_model_dir).model), CONFIG, pad_id=PAD)
        start_sharded(group, trainer, "", plain.model.state_dict())
        taken: list[int] = []

        def take(nbytes: int, device: torch.device) -> torch.Tensor:
            taken.append(nbytes)
            return torch.full((nbytes,), 7, dtype=torch.uint8, device=device)  # not zeroed

        packed = pack_share(
            trainer.model,
            rank=rank,
            world_size=2,
            bucket_bytes=4096,
            algorithm="xxh3_128",
            take_buffer=take,
        )
        embed = dict(trainer.model.named_parameters())["model.embed_tokens.weight"]
        assert isinstance(embed, DTensor)
        with torch.no_grad():
            if rank == 1:
                embed.to_local()[-1, 0] = float("nan")  # the last row: rank 1's shard
        poisoned = pack_share(
            trainer.model,
            rank=rank,
            world_size=2,
            bucket_bytes=1 << 20,
            algorithm="xxh3_128",
            take_buffer=take,
        )
        share = packed.share
        torch.save(
            {
                "first": share.first,
                "stop": share.stop,
                "checksums": share.checksums,
                "bytes": share.buffer.clone(),
                "taken": taken,
                "nonfinite": packed.nonfinite,
                "poisoned": poisoned.nonfinite,
            },
            out / f"share-rank{rank}.pt",
        )
    finally:
        group.close()


@pytest.mark.timeout(90)
def test_fsdp_ranks_publish_from_their_shards_what_one_whole_copy_packs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _two_ranks(_share_rank_main, f"127.0.0.1:{free_port()}", tiny_model_dir, tmp_path)
    ranks = [torch.load(tmp_path / f"share-rank{r}.pt", weights_only=False) for r in range(2)]

    whole = list(_trainer(tiny_model_dir).model.state_dict().items())
    entries, total, spans = plan_layout(whole, 4096)
    buffer = torch.empty(total, dtype=torch.uint8)
    pack_into(whole, entries, buffer)
    expected = [bucket_checksum(buffer[o : o + n], "xxh3_128") for o, n in spans]

    # Every rank has every bucket's checksum; together the shares are the whole buffer.
    assert [r["checksums"] for r in ranks] == [tuple(expected)] * 2
    assert (ranks[0]["first"], ranks[0]["stop"], ranks[1]["stop"]) == (
        0,
        ranks[1]["first"],
        len(spans),
    )
    assert torch.equal(torch.cat([r["bytes"] for r in ranks]), buffer)
    # No rank took more than its half of the version (one bucket of rounding).
    for r in ranks:
        assert r["taken"][0] == r["bytes"].numel() <= total / 2 + 4096
    assert [r["nonfinite"] for r in ranks] == [[], []]
    # A NaN in rank 1's rows is seen by whichever rank packs them, and told to every rank.
    assert [r["poisoned"] for r in ranks] == [["model.embed_tokens.weight"]] * 2
