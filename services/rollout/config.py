"""Rollout settings (env prefix ROBUSTRL_ROLLOUT_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import ServiceSettings


class RolloutSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_ROLLOUT_", extra="ignore")

    torch_threads: int = Field(default=1, ge=1)
    """CPU threads torch may use (roles share a host's cores on the local stack)."""

    standby: bool = False
    """A warm standby: registered with label standby=true, never bound to a new job. Once the
    leader prepares it for a running job it starts the engine and keeps pulling the job's
    weights (serving them as a relay), to replace a lost rollout of that job at once."""

    groups_per_lease: int = Field(default=16, ge=1)
    """Prompt groups asked for (and generated as one batch) per lease."""

    vllm_kv_cache_mib: int = Field(default=0, ge=0)
    """KV cache of a vLLM engine (rollout.engine: vllm), MiB. 0: 256 MiB on a host without
    CUDA (vLLM's CPU backend otherwise reserves a share of the host's memory), and
    `vllm_gpu_memory_utilization` of the GPU on a GPU host."""

    vllm_gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    """Share of the GPU's memory a vLLM engine may take on a GPU host (weights, activations
    and KV cache), when `vllm_kv_cache_mib` is 0."""
