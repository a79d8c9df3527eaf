"""Provisioners start replacement members; the recovery executor asks, the registry tells.

A request names a role and why. The provisioner starts a member of that role somewhere; the
new member registers in etcd like any other, and the leader binds it to the job that needs
it. So a provisioner never talks to the job: `local` starts a service process on this host,
and a scheduler-backed one (Slurm, Kubernetes) would submit a pod or a job step instead and
let the member register itself — the interface is the same.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path

import aetcd
from pydantic import BaseModel

from services.common.config import EtcdSettings, member_argv, member_env
from services.common.keys import KeySpace
from services.common.logs import get_logger

log = get_logger(__name__)

ROLES = ("trainer", "rollout")


class ProvisionedRecord(BaseModel):
    """`<prefix>/provisioned/<instance_id>`: what `robustrl down` must stop as well."""

    instance_id: str
    role: str
    pid: int
    host: str
    argv: list[str]
    log: str
    job_id: str
    reason: str
    at: float


class Provisioner(ABC):
    @abstractmethod
    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        """Start a member of `role` (a warm standby trainer if `standby`); returns its instance
        id (it registers on its own)."""


class NoProvisioner(Provisioner):
    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        log.info("provision.waiting_for_member", role=role, job=job_id, reason=reason)
        return ""


class LocalProvisioner(Provisioner):
    """Starts `python -m services.<role>` on this host, with this process's ROBUSTRL_* env."""

    def __init__(
        self, client: aetcd.Client, keys: KeySpace, etcd: EtcdSettings, log_dir: str = ""
    ) -> None:
        self.client = client
        self.keys = keys
        self.etcd = etcd
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="robustrl-provisioned-"))
        # Held so asyncio keeps reaping them; nothing else reads it.
        self._procs: list[asyncio.subprocess.Process] = []

    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        if role not in ROLES:
            raise ValueError(f"cannot provision a {role}; only {', '.join(ROLES)}")
        instance_id = f"{'standby' if standby else role}-p{secrets.token_hex(3)}"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(
                (f"ROBUSTRL_{role.upper()}_INSTANCE_ID", f"ROBUSTRL_{role.upper()}_PORT")
            )
        }
        env |= member_env(self.etcd.endpoints, self.etcd.prefix, role, instance_id)
        if standby:
            env["ROBUSTRL_TRAINER_STANDBY"] = "true"
        argv = member_argv(role)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance_id}.log"
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=fd,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # outlives this coordinator if it is the one that fails
            )
        finally:
            os.close(fd)
        self._procs.append(proc)
        record = ProvisionedRecord(
            instance_id=instance_id,
            role=role,
            pid=proc.pid,
            host=socket.gethostname(),
            argv=argv,
            log=str(log_path),
            job_id=job_id,
            reason=reason,
            at=time.time(),
        )
        await self.client.put(self.keys.provisioned(instance_id), record.model_dump_json().encode())
        log.info("provision.started", role=role, member=instance_id, pid=proc.pid, job=job_id)
        return instance_id


async def list_provisioned(client: aetcd.Client, keys: KeySpace) -> list[ProvisionedRecord]:
    return [
        ProvisionedRecord.model_validate_json(kv.value)
        for kv in await client.get_prefix(keys.provisioned())
    ]
