"""Rollout settings (env prefix ROBUSTRL_ROLLOUT_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import MemberSettings


class RolloutSettings(MemberSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_ROLLOUT_", extra="ignore")

    groups_per_lease: int = Field(default=16, ge=1)
    """Prompt groups asked for (and generated as one batch) per lease."""

    vllm_kv_cache_mib: int = Field(default=0, ge=0)
    """KV cache of a vLLM engine (rollout.engine: vllm), MiB. 0: 256 MiB on a host without
    CUDA (vLLM's CPU backend otherwise reserves a share of the host's memory), and
    `vllm_gpu_memory_utilization` of the GPU on a GPU host."""

    vllm_max_model_len: int = Field(default=0, ge=0)
    """Positions a vLLM engine serves (vLLM's `max_model_len`): prompt and completion
    together. 0: the model's whole context (`max_position_embeddings`). Less starts sooner:
    vLLM sizes its start-up run by it. A prompt that leaves fewer than `max_new_tokens` of it
    is refused as over the context, as one over the model's would be."""

    vllm_gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    """Share of the GPU's memory a vLLM engine may take on a GPU host (weights, activations
    and KV cache), when `vllm_kv_cache_mib` is 0."""
