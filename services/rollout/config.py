"""Rollout settings (env prefix ROBUSTRL_ROLLOUT_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import ServiceSettings


class RolloutSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_ROLLOUT_", extra="ignore")

    torch_threads: int = Field(default=1, ge=1)
    """CPU threads torch may use (roles share a host's cores on the local stack)."""

    groups_per_lease: int = Field(default=16, ge=1)
    """Prompt groups asked for (and generated as one batch) per lease."""
