"""Rollout settings (env prefix ROBUSTRL_ROLLOUT_)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class RolloutSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_ROLLOUT_", extra="ignore")
