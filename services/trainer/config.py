"""Trainer settings (env prefix ROBUSTRL_TRAINER_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import MemberSettings


class TrainerSettings(MemberSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_TRAINER_", extra="ignore")

    runs_dir: str = ".robustrl/runs"
    """Where each job's run directory goes: metrics.jsonl, reward.png, checkpoints/."""

    keep_checkpoints: int = Field(default=2, ge=1)
    """Per-step checkpoints kept on disk per job (older ones are deleted)."""
