"""Provisioners start replacement members; the recovery executor asks, the registry tells.

A request names a role and why. The provisioner starts a member of that role somewhere; the
new member registers in etcd like any other, and the leader binds it to the job that needs
it. So a provisioner never talks to the job: `local` starts a service process on this host;
`external` hands the request to a scheduler (a Slurm or Kubernetes operator) connected over
the Provisioning gRPC stream, which submits a job step or a pod and lets the member register
itself. A Docker or Kubernetes provisioner in the coordinator would be one more subclass.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aetcd

from robustrl.contracts.errors import AlreadyExists, InvalidArgument, NotFound
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.provisioning import ProvisionedRecord
from robustrl.contracts.roles import DATA_PLANE_ROLES as ROLES
from robustrl.contracts.roles import ROLE_FROM_PROTO, ROLE_TO_PROTO
from robustrl.core.aio import cancel_and_wait
from robustrl.core.config import EtcdSettings, member_argv, member_env
from robustrl.core.logs import get_logger
from robustrl.core.template import AttachedTemplate, WarmTemplate
from robustrl.v1 import provisioning_pb2

log = get_logger(__name__)


class Provisioner(ABC):
    on_failure: Callable[[str, str], None] | None = None
    """Called with (job_id, role) when a member asked for will not come (the scheduler said
    so), so the caller asks again at once instead of waiting for it."""

    @abstractmethod
    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        """Start a member of `role` (a warm standby of it if `standby`); returns its instance
        id (it registers on its own)."""

    async def close(self) -> None:  # noqa: B027 - most provisioners hold nothing to stop
        """Stop what the provisioner runs itself (not the members it started)."""


def new_member(role: str, standby: bool) -> str:
    """A fresh instance id for a provisioned member; ValueError for a role nobody provisions."""
    if role not in ROLES:
        raise ValueError(f"cannot provision a {role}; only {', '.join(ROLES)}")
    # A standby trainer is "standby-p…" as before standby rollouts existed; a standby rollout
    # names its role.
    kind = {"trainer": "standby", "rollout": "standby-rollout"}[role] if standby else role
    return f"{kind}-p{secrets.token_hex(3)}"


class NoProvisioner(Provisioner):
    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        log.info("provision.waiting_for_member", role=role, job=job_id, reason=reason)
        return ""


class LocalProvisioner(Provisioner):
    """Starts `python -m services.<role>` on this host, with this process's ROBUSTRL_* env:
    forked from the warm template (`robustrl/core/template.py`: the stack's, or one of its
    own started with the first member) once it is up, else a fresh interpreter."""

    def __init__(
        self,
        client: aetcd.Client,
        keys: KeySpace,
        etcd: EtcdSettings,
        log_dir: str = "",
        *,
        template: bool = True,
        template_socket: str = "",
    ) -> None:
        self.client = client
        self.keys = keys
        self.etcd = etcd
        # Without a log_dir, a temporary one is made when the first member starts: a
        # coordinator that never provisions leaves no empty directory behind.
        self.log_dir = Path(log_dir) if log_dir else None
        self.use_template = template
        self.template_socket = template_socket
        """The stack's template (`robustrl up` started it): used instead of one of our own."""
        self.template: WarmTemplate | AttachedTemplate | None = None
        """Started with the first member: a coordinator that never provisions runs none."""
        # Held so asyncio keeps reaping them; nothing else reads it.
        self._procs: list[asyncio.subprocess.Process] = []
        self._launching: set[asyncio.Task[None]] = set()

    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        instance_id = new_member(role, standby)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(
                (f"ROBUSTRL_{role.upper()}_INSTANCE_ID", f"ROBUSTRL_{role.upper()}_PORT")
            )
        }
        env |= member_env(self.etcd.endpoints, self.etcd.prefix, role, instance_id)
        if standby:
            env[f"ROBUSTRL_{role.upper()}_STANDBY"] = "true"
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="robustrl-provisioned-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance_id}.log"
        if self.use_template and self.template is None:
            self.template = (
                AttachedTemplate(self.template_socket)
                if self.template_socket
                else WarmTemplate(self.log_dir)
            )
            await self.template.start()
        launch = self._launch(instance_id, role, env, log_path, job_id, reason)
        if self.template is None or self.template.ready:
            await launch
            return instance_id
        # The template is still importing: the member waits for it off the caller's path (a
        # recovery holds the job's lock while it asks; its data must not wait on imports).
        task = asyncio.create_task(self._launch_quietly(launch, role, job_id))
        self._launching.add(task)
        task.add_done_callback(self._launching.discard)
        return instance_id

    async def _launch(
        self,
        instance_id: str,
        role: str,
        env: dict[str, str],
        log_path: Path,
        job_id: str,
        reason: str,
    ) -> None:
        pid, argv, how = await self._start(role, env, log_path)
        record = ProvisionedRecord(
            instance_id=instance_id,
            role=role,
            pid=pid,
            host=socket.gethostname(),
            argv=argv,
            log=str(log_path),
            job_id=job_id,
            reason=reason,
            at=time.time(),
        )
        await self.client.put(self.keys.provisioned(instance_id), record.model_dump_json().encode())
        log.info("provision.started", role=role, member=instance_id, pid=pid, job=job_id, how=how)

    async def _launch_quietly(self, launch: Awaitable[None], role: str, job_id: str) -> None:
        try:
            await launch
        except Exception as exc:
            log.error("provision.start_failed", role=role, job=job_id, error=repr(exc)[:300])
            if self.on_failure is not None:
                self.on_failure(job_id, role)

    async def _start(
        self, role: str, env: dict[str, str], log_path: Path
    ) -> tuple[int, list[str], str]:
        """The member's pid, its command line, and how it started: `forked` from the
        template, or `fresh`."""
        if self.template is not None:
            forked = await self.template.fork(f"services.{role}", env, log_path)
            if forked is not None:
                return *forked, "forked"
        argv = member_argv(role)
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
        return proc.pid, argv, "fresh"

    async def close(self) -> None:
        await cancel_and_wait(*self._launching)
        if self.template is not None:
            await self.template.close()


@dataclass
class Scheduler:
    """One scheduler connected to the Provisioning stream."""

    name: str
    roles: frozenset[str]
    outbox: asyncio.Queue[provisioning_pb2.ProvisionRequest] = field(default_factory=asyncio.Queue)


@dataclass
class PendingRequest:
    message: provisioning_pb2.ProvisionRequest
    sent_to: str | None = None
    """The scheduler it was sent to; None while it waits for one."""

    @property
    def role(self) -> str:
        return ROLE_FROM_PROTO[self.message.role]


class ExternalProvisioner(Provisioner):
    """Hands each request to a connected scheduler that offers the role (the one with the
    fewest requests outstanding) and keeps it until that scheduler reports on it. A request
    made while no such scheduler is connected, or sent on a stream that broke before the
    report, goes to the next one that connects: nothing asked for is dropped. Pending requests
    live in the leader's memory. A new leader asks again for what its jobs still miss once
    `driver.ASKED_FOR_S` has passed since the last ask (stored in etcd): one that a scheduler
    had taken is not asked for twice, one that none had taken yet is asked for again then."""

    def __init__(self, etcd: EtcdSettings) -> None:
        self.etcd = etcd
        self.pending: dict[str, PendingRequest] = {}
        self.schedulers: dict[str, Scheduler] = {}

    async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
        instance_id = new_member(role, standby)
        env = member_env(self.etcd.endpoints, self.etcd.prefix, role, instance_id)
        if standby:
            env[f"ROBUSTRL_{role.upper()}_STANDBY"] = "true"
        message = provisioning_pb2.ProvisionRequest(
            request_id=f"prov-{secrets.token_hex(4)}",
            role=ROLE_TO_PROTO[role],
            instance_id=instance_id,
            job_id=job_id,
            reason=reason,
            standby=standby,
            env=env,
            argv=member_argv(role),
        )
        self.pending[message.request_id] = PendingRequest(message)
        sent_to = self._dispatch(self.pending[message.request_id])
        log.info(
            "provision.requested",
            role=role,
            member=instance_id,
            job=job_id,
            request=message.request_id,
            scheduler=sent_to or "none connected; kept until one is",
        )
        return instance_id

    def connect(self, hello: provisioning_pb2.ProvisionerHello) -> Scheduler:
        """A scheduler said hello: register it and send it what waits for its roles."""
        if not hello.name:
            raise InvalidArgument("the hello must name the scheduler")
        if hello.name in self.schedulers:
            raise AlreadyExists(f"a scheduler named {hello.name!r} is already connected")
        roles = {ROLE_FROM_PROTO.get(r, str(r)) for r in hello.roles} or set(ROLES)
        if not roles <= set(ROLES):
            raise InvalidArgument(
                f"a scheduler can offer only {', '.join(ROLES)}, not {sorted(roles - set(ROLES))}"
            )
        scheduler = Scheduler(hello.name, frozenset(roles))
        self.schedulers[scheduler.name] = scheduler
        waiting = [p for p in self.pending.values() if p.sent_to is None]
        for pending in waiting:
            self._dispatch(pending)
        log.info(
            "provision.scheduler_connected",
            scheduler=scheduler.name,
            roles=sorted(scheduler.roles),
            sent=sum(p.sent_to == scheduler.name for p in waiting),
        )
        return scheduler

    def disconnect(self, scheduler: Scheduler) -> None:
        """Its stream ended: what it did not report on goes to another scheduler, or waits."""
        if self.schedulers.get(scheduler.name) is not scheduler:
            return
        del self.schedulers[scheduler.name]
        orphans = [p for p in self.pending.values() if p.sent_to == scheduler.name]
        for pending in orphans:
            pending.sent_to = None
            self._dispatch(pending)
        log.warning("provision.scheduler_gone", scheduler=scheduler.name, unreported=len(orphans))

    def report(self, scheduler: Scheduler, report: provisioning_pb2.ProvisionReport) -> None:
        pending = self.pending.get(report.request_id)
        if pending is None or pending.sent_to != scheduler.name:
            raise NotFound(
                f"no request {report.request_id!r} is waiting for a report from {scheduler.name!r}"
            )
        del self.pending[report.request_id]
        message = pending.message
        about = log.bind(
            role=pending.role,
            member=message.instance_id,
            job=message.job_id,
            scheduler=scheduler.name,
        )
        if report.ok:
            about.info("provision.started", detail=report.detail)
            return
        about.error("provision.failed", error=report.error)
        if self.on_failure is not None:
            self.on_failure(message.job_id, pending.role)

    def _dispatch(self, pending: PendingRequest) -> str | None:
        offering = [s for s in self.schedulers.values() if pending.role in s.roles]
        if not offering:
            return None

        def outstanding(s: Scheduler) -> int:
            return sum(p.sent_to == s.name for p in self.pending.values())

        chosen = min(offering, key=lambda s: (outstanding(s), s.name))
        pending.sent_to = chosen.name
        chosen.outbox.put_nowait(pending.message)
        return chosen.name
