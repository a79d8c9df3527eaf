"""Trainer settings (env prefix ROBUSTRL_TRAINER_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import ServiceSettings


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_TRAINER_", extra="ignore")

    runs_dir: str = ".robustrl/runs"
    """Where each job's run directory goes: metrics.jsonl, reward.png, checkpoints/."""

    torch_threads: int = Field(default=1, ge=1)
    """CPU threads torch may use (roles share a host's cores on the local stack)."""

    keep_checkpoints: int = Field(default=2, ge=1)
    """Per-step checkpoints kept on disk per job (older ones are deleted)."""

    standby: bool = False
    """A warm standby: registered with label standby=true, its libraries loaded, never bound
    to a new job — only promoted to replace a failed trainer (restoring its checkpoint)."""
