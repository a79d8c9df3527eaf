"""Settings shared by every service, read from ROBUSTRL_* environment variables.

Each service's own Settings (in its config.py) extends `ServiceSettings` with its env prefix,
e.g. ROBUSTRL_COORDINATOR_PORT. Settings every service needs (where etcd is, the key
namespace) are read without a service prefix so one environment serves the whole stack.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from robustrl.core.processes import may_raise_priority

_INCARNATION = secrets.token_hex(3)
"""Drawn once per process: part of a default instance id (ServiceSettings.instance_id)."""


def _draw_incarnation() -> None:
    global _INCARNATION
    _INCARNATION = secrets.token_hex(3)


os.register_at_fork(after_in_child=_draw_incarnation)  # a forked member is a new process too


class EtcdSettings(BaseSettings):
    """Where etcd is and how we use it. Env: ROBUSTRL_ETCD_ENDPOINTS, ROBUSTRL_ETCD_PREFIX, ..."""

    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_ETCD_", extra="ignore")

    endpoints: str = "127.0.0.1:2379"
    """Comma-separated host:port list of etcd client endpoints; the first that answers is used."""

    prefix: str = "/robustrl"
    """Key namespace: every key robustrl writes lives under it (lets stacks share one etcd)."""

    session_ttl: int = Field(default=5, ge=1, le=3600)
    """Lease TTL in seconds: a member that stops refreshing is gone from the registry after it."""

    timeout: float = Field(default=5.0, gt=0)
    """Deadline in seconds for each etcd request."""

    @field_validator("prefix")
    @classmethod
    def _prefix_shape(cls, value: str) -> str:
        if not value.startswith("/") or value.endswith("/") or len(value) < 2:
            raise ValueError("must start with '/' and not end with '/', e.g. /robustrl")
        return value

    def endpoint_list(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for raw in self.endpoints.split(","):
            item = raw.strip().removeprefix("http://")
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd endpoint {raw!r} is not host:port")
            out.append((host, int(port)))
        return out


class ServiceSettings(BaseSettings):
    """What every service's Settings has. Subclasses set their own env prefix."""

    model_config = SettingsConfigDict(env_prefix="ROBUSTRL_SERVICE_", extra="ignore")

    instance_id: str = ""
    """Id of this process in the registry; empty: '<role>-<host>-<pid>-<6 hex drawn at start>',
    new for every process. A fence names an instance id, so a process started under the id of
    one that was fenced from a job is never bound to that job: give each process its own
    (a container or pod restarted in place keeps its hostname, and often its pid)."""

    bind_host: str = "127.0.0.1"
    """Interface the gRPC server listens on (0.0.0.0 in containers)."""

    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (the real port is registered in etcd)."""

    advertise_host: str = ""
    """Host other services use to reach this one; empty: bind_host (the hostname for 0.0.0.0)."""

    epoch: int = Field(default=0, ge=0)
    """Fencing epoch this instance starts with (a replacement gets a higher one)."""

    heartbeat_interval: float = Field(default=0.5, gt=0)
    """Seconds between heartbeats sent to the monitor."""

    exit_when_fenced: bool = False
    """Trainer and rollout: exit (as on SIGTERM) once fenced, instead of staying registered as a
    member no job of its fence may use. Where a supervisor restarts what exits (compose's restart
    policy, Kubernetes), the process comes back as a new instance, free for any job."""

    shutdown_grace: float = Field(default=2.0, ge=0)
    """Seconds in-flight RPCs get to finish on shutdown."""

    log_format: str = "console"
    """'console' for people, 'json' for containers."""

    log_level: str = "info"

    def resolved_instance_id(self, role: str) -> str:
        return self.instance_id or f"{role}-{socket.gethostname()}-{os.getpid()}-{_INCARNATION}"

    def resolved_advertise_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in ("0.0.0.0", "::", "[::]"):
            return socket.gethostname()
        return self.bind_host


class MemberSettings(ServiceSettings):
    """What the roles a job binds (trainer, rollout) have beyond every service's settings."""

    torch_threads: int = Field(default=1, ge=1)
    """CPU threads torch may use (roles share a host's cores on the local stack)."""

    standby: bool = False
    """A warm standby: registered with label standby=true, never bound to a new job. The
    leader prepares it for a running job (a trainer builds the model, a rollout also starts its
    engine and keeps pulling the job's weights, serving them as a relay) and binds it at once
    to replace that job's failed member of its role."""

    standby_nice: int = Field(default=0, ge=0, le=19)
    """How far a standby yields the CPU: it runs this much nicer (Linux niceness, every thread
    and every process it starts) from its start until it is bound, and at its start niceness
    from then on. A standby started beside a job's members (the local stack, a refill) then
    builds its model and pulls weights with what CPU the job leaves. Going back needs
    CAP_SYS_NICE (or RLIMIT_NICE): without it a non-zero value is refused at start."""

    @model_validator(mode="after")
    def _standby_may_go_back(self) -> MemberSettings:
        if self.standby and self.standby_nice and not may_raise_priority(os.nice(0)):
            raise ValueError(
                f"standby_nice={self.standby_nice}: this process may not raise its priority "
                "back when bound (no CAP_SYS_NICE, RLIMIT_NICE too low); set it to 0"
            )
        return self

    def labels(self) -> dict[str, str]:
        """The member's registry labels its settings decide."""
        return {"standby": "true"} if self.standby else {}


def member_env(endpoints: str, prefix: str, role: str, instance_id: str) -> dict[str, str]:
    """The environment a service process needs on top of the caller's to join a stack as
    `instance_id` (the local stack and the local provisioner start members with it)."""
    return {
        "ROBUSTRL_ETCD_ENDPOINTS": endpoints,
        "ROBUSTRL_ETCD_PREFIX": prefix,
        f"ROBUSTRL_{role.upper()}_INSTANCE_ID": instance_id,
        "PYTHONUNBUFFERED": "1",
    }


def member_argv(role: str) -> list[str]:
    """The command line of a `role` service process."""
    return [sys.executable, "-m", f"services.{role}"]
