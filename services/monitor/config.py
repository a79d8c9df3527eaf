"""Monitor settings (env prefix ROBUSTRL_MONITOR_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class MonitorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_MONITOR_", extra="ignore")

    reconnect_grace: float = Field(default=1.0, ge=0)
    """Seconds a member whose heartbeat stream broke without a goodbye has to reconnect
    before it is declared lost (a network blip is not a crash; a kill -9 is caught sooner
    than its lease expiry)."""

    evaluate_interval: float = Field(default=0.2, gt=0)
    """Seconds between detector evaluations."""
