"""Monitor settings (env prefix ROBUSTRL_MONITOR_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import ServiceSettings
from services.monitor.progress_detectors import ProgressConfig


class MonitorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_MONITOR_", extra="ignore")

    allocator: Literal["jemalloc", "python"] = "jemalloc"
    """Memory allocator of the monitor process. `jemalloc` (where the host has libjemalloc)
    runs the monitor again at start with jemalloc preloaded for every allocation, so that
    memory freed once many members have left goes back to the system; `python` keeps
    CPython's own small-object allocator, which keeps it."""

    reconnect_grace: float = Field(default=1.0, ge=0)
    """Seconds a member whose heartbeat stream broke without a goodbye has to reconnect
    before it is declared lost (a network blip is not a crash; a kill -9 is caught sooner
    than its lease expiry)."""

    listen_check_window: float = Field(default=0.5, ge=0)
    """Seconds the monitor keeps trying to connect to a member whose heartbeat stream broke
    without a goodbye. A refusal (nothing listens at its address) reports it lost at once;
    connections accepted throughout, timeouts or an unreachable host leave it to the
    reconnect grace. 0 turns the check off."""

    evaluate_interval: float = Field(default=0.2, gt=0)
    """Seconds between detector evaluations."""

    rollout_hang_window: float = Field(default=ProgressConfig.rollout_hang_window, gt=0)
    """Seconds a rollout may go without a new token while it has requests in flight before
    it is probed. A long-tail generation keeps producing tokens and an idle rollout has no
    requests, so neither is ever probed."""

    silence_window: float = Field(default=ProgressConfig.silence_window, gt=0)
    """Seconds without a beat on a member's open heartbeat stream (a frozen process: beats
    come from its event loop, not its work) before it is probed."""

    probe_wait: float = Field(default=2.0, gt=0, le=60)
    """Seconds a probed rollout is given to show a new token."""

    probe_deadline: float = Field(default=2.0, gt=0)
    """Seconds, beyond probe_wait, a probed member has to answer at all."""

    phase_budgets: dict[str, float] = Field(
        default_factory=lambda: dict(ProgressConfig().phase_budgets)
    )
    """Seconds each trainer phase may take before it is a hang (forward_backward, optimizer,
    checkpoint, publish, eval). Phases not listed have no budget: waiting_data, waiting_etcd
    and waiting_coordinator (an etcd outage is not a trainer hang).
    As env: ROBUSTRL_MONITOR_PHASE_BUDGETS='{"checkpoint": 600}'."""

    collective_budget: float = Field(default=ProgressConfig.collective_budget, gt=0)
    """Seconds trainer ranks may wait in one collective before the rank that has not
    entered it is named."""

    view_retention: float = Field(default=60.0, ge=0)
    """Seconds the monitor keeps what it knew of a member that left the registry and beats
    to it no more, before it forgets it (memory stays bounded under churn)."""

    incident_mark_ttl: int = Field(default=600, ge=10)
    """Seconds the marks of the failures this monitor recorded outlive it (their lease's TTL):
    the monitor that takes its members over records none of them again."""

    degraded_ratio: float = Field(default=ProgressConfig.degraded_ratio, gt=0, lt=1)
    """A rollout below this fraction of its peers' median tokens/s gets a DEGRADED warning."""

    def progress_config(self) -> ProgressConfig:
        return ProgressConfig(
            rollout_hang_window=self.rollout_hang_window,
            phase_budgets=dict(self.phase_budgets),
            collective_budget=self.collective_budget,
            degraded_ratio=self.degraded_ratio,
            silence_window=self.silence_window,
        )
