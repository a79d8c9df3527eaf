"""Where a trainer computes: `trainer.device` and `trainer.dtype` against what the host has,
and a sharded checkpoint read into a model it does not belong to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import TrainerSpec
from robustrl.generation.modelgen import ModelShape, init_model
from services.trainer.devices import compute_for
from services.trainer.grpo import GRPOConfig, GRPOTrainer
from services.trainer.ranks.sharding import CheckpointMismatch, load_sharded


def test_a_host_without_cuda_computes_fp32_on_the_cpu_and_refuses_cuda_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = compute_for(TrainerSpec())
    assert (auto.device, auto.autocast, auto.backend) == (torch.device("cpu"), None, "gloo")
    with pytest.raises(InvalidArgument, match=r"trainer\.device: cuda, but this trainer's host"):
        compute_for(TrainerSpec(device="cuda"))
    with pytest.raises(InvalidArgument, match=r"trainer\.dtype: bf16 is mixed precision on CUDA"):
        compute_for(TrainerSpec(dtype="bf16"))


def test_a_cuda_host_computes_bf16_on_the_ranks_device_with_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rank_1 = compute_for(TrainerSpec(world_size=2), rank=1)
    assert (rank_1.device, rank_1.autocast) == (torch.device("cuda", 1), torch.bfloat16)
    assert rank_1.backend == "cpu:gloo,cuda:nccl"
    # Ranks are members on any host: rank 2 of 3 on a host of 2 GPUs takes the first.
    assert compute_for(TrainerSpec(world_size=3), rank=2).device == torch.device("cuda", 0)
    assert compute_for(TrainerSpec(dtype="fp32")).autocast is None
    assert compute_for(TrainerSpec(device="cpu")).device == torch.device("cpu")


def test_a_sharded_checkpoint_of_another_model_is_refused_naming_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = init_model(tmp_path / "other", seed=0, shape=ModelShape(hidden_size=64, num_layers=1))

    def trainer(path: Path) -> GRPOTrainer:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return GRPOTrainer(model, GRPOConfig(), pad_id=0)

    written = trainer(other)
    state = {"model": written.model.state_dict(), "optimizer": {}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    reader = trainer(tiny_model_dir)
    before = {k: v.clone() for k, v in reader.model.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match=f"{tmp_path / 'ckpt'}: not a checkpoint of"):
        load_sharded(reader.model, reader.optimizer, tmp_path / "ckpt", alone=True)
    for name, value in reader.model.state_dict().items():
        assert torch.equal(value, before[name]), name  # nothing changed
