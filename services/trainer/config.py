"""Trainer settings (env prefix ROBUSTRL_TRAINER_)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_TRAINER_", extra="ignore")
