"""Which inference engine a job's rollout runs (`rollout.engine`), built for this host."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from robustrl.contracts.jobspec import JobSpec
from robustrl.generation.engine import Engine, TorchEngine
from services.rollout.config import RolloutSettings

CPU_KV_CACHE_MIB = 256
"""A vLLM engine's KV cache on a host without CUDA when the settings leave it to us."""


def build_engine(spec: JobSpec, settings: RolloutSettings) -> Engine:
    """The job's engine for `spec.model.path`; vLLM's raises EngineStartError when it cannot
    start (the model, or the host)."""
    path = Path(spec.model.path)
    if spec.rollout.engine == "torch":
        # On the host's GPU where it has one, in the checkpoint's dtype.
        return TorchEngine.from_pretrained(
            str(path), device="cuda" if torch.cuda.is_available() else "cpu"
        )
    from robustrl.generation.vllm_engine import VLLMEngine

    on_cpu = not torch.cuda.is_available()
    kv_mib = settings.vllm_kv_cache_mib
    if kv_mib == 0 and on_cpu:
        kv_mib = CPU_KV_CACHE_MIB
    return VLLMEngine(
        path,
        seed=spec.seed,
        max_model_len=settings.vllm_max_model_len or None,
        kv_cache_bytes=kv_mib << 20 if kv_mib else None,
        gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
        cpu_threads=settings.torch_threads if on_cpu else None,
    )


def engine_context(spec: JobSpec, settings: RolloutSettings, path: Path) -> int:
    """The positions the job's engine will serve: the model's context, or less where a vLLM
    engine is limited (`vllm_max_model_len`); ValueError when the config cannot say."""
    context = model_context(path)
    if spec.rollout.engine == "vllm" and settings.vllm_max_model_len:
        return min(context, settings.vllm_max_model_len)
    return context


def model_context(path: Path) -> int:
    """The model's context in positions (`max_position_embeddings` of its config), read without
    building an engine; ValueError when the config cannot say."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers' own errors for a config it cannot read
        raise ValueError(f"cannot read the model's config in {path}: {exc}") from exc
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        raise ValueError(f"the config in {path} names no max_position_embeddings")
    return context
