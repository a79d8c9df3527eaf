"""Coordinator settings (env prefix ROBUSTRL_COORDINATOR_)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class CoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_COORDINATOR_", extra="ignore")

    election_name: str = "coordinator"
    """Name of the etcd election the replicas campaign in."""
