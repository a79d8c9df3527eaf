"""Coordinator settings (env prefix ROBUSTRL_COORDINATOR_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from robustrl.core.config import ServiceSettings


class CoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_COORDINATOR_", extra="ignore")

    election_name: str = "coordinator"
    """Name of the etcd election the replicas campaign in."""

    tick_interval: float = Field(default=0.5, gt=0)
    """Seconds between the leader's supervision rounds (binding, lease expiry, releases)."""

    lease_seconds: float = Field(default=60.0, gt=0)
    """How long a rollout may hold a prompt group before it is leased to another."""

    unreported_loss_after: float = Field(default=15.0, gt=0)
    """Seconds a member bound to a running job may be missing from the registry, with no
    monitor reporting it, before the leader records its loss itself (a MEMBER_LOST incident,
    recovered as any other). For a member that failed while no monitor ran; a running monitor
    reports a loss within the session TTL, and a member whose lease lapsed in an etcd outage
    registers again within seconds of etcd's return."""

    ledger_page_size: int = Field(default=512, ge=1)
    """Dropped groups and take-backs a job's work ledger lists before they move to a page of
    their own (<prefix>/dropped/<job>/<n>): the ledger, rewritten on every lease, stays small
    however many groups a long job drops."""

    etcd_space_recovery: bool = True
    """Whether the leader gets etcd out of NOSPACE by itself (coordinator/space.py: compact,
    defragment each member, disarm), which otherwise stops every job until a person does it.
    Off where etcd's operators run their own maintenance."""

    provisioner: Literal["local", "external", "none"] = "local"
    """Who starts replacement members: `local` starts service processes on this host (the
    local stack); `external` sends each request to a scheduler connected over the
    Provisioning gRPC stream (`robustrl provider`, or a Slurm/Kubernetes operator's own
    client); `none` starts nothing and waits for a free member of the role to appear in the
    registry (an operator starts them)."""

    provision_log_dir: str = ""
    """Where the local provisioner writes its processes' logs; empty: a temp directory."""

    provision_template: bool = True
    """The local provisioner forks members from a warm template process that imported the
    trainer's and rollout's libraries once (started with the first member it provisions): a
    member then skips about 5 s of a core of imports (decision 0307). False: every member
    starts as a fresh interpreter."""

    provision_template_socket: str = ""
    """The Unix socket of a template already running on this host (`robustrl up` starts one
    for its stack and sets this): the local provisioner forks from it instead of starting its
    own (decision 0023). Empty: its own, as `provision_template` says."""
