"""`robustrl provider --exec CMD`: a scheduler for the `external` provisioner.

It finds the coordinator leader in etcd, opens the Provisioning stream, says hello with the
roles it offers, and for every ProvisionRequest runs CMD through the shell with the request in
its environment:
- the member's own variables (`request.env`: etcd endpoints and prefix, its instance id,
  standby), so CMD can pass them on to the member;
- ROBUSTRL_PROVISION_REQUEST_ID, _ROLE, _INSTANCE_ID, _JOB, _STANDBY ("true"/"false"),
  _REASON, and _ARGV: the coordinator's command for the member on its own host, shell-quoted.
CMD should submit or start the member and exit: `sbatch rollout.sbatch`, a `kubectl apply`,
or on this host `$ROBUSTRL_PROVISION_ARGV >member.log 2>&1 &` (a member left running in the
background must not keep CMD's stdout open, or CMD never finishes). Exit status 0 is reported
as started, with CMD's last line of output as the detail; anything else, or running past
`--timeout`, as failed with the end of its stderr, and the coordinator asks again.

When the stream breaks (the leader failed over, etcd was away) it connects again to whichever
coordinator leads then; requests it had not reported on are sent to it (or to another
scheduler) again, so CMD should tolerate a request id it has seen before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
from collections.abc import AsyncIterator, Sequence

import grpc

from robustrl.contracts.provisioning import ACCEPTED_METADATA_KEY
from robustrl.contracts.roles import ROLE_FROM_PROTO, ROLE_TO_PROTO
from robustrl.core.coordinator_client import CoordinatorClient
from robustrl.core.logs import get_logger
from robustrl.v1 import provisioning_pb2, provisioning_pb2_grpc

log = get_logger(__name__)

FATAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Stream errors that connecting again will not fix (a bad hello, a coordinator that does not
take an external provisioner): the provider stops with the coordinator's message."""


class ProviderError(RuntimeError):
    pass


def request_env(request: provisioning_pb2.ProvisionRequest) -> dict[str, str]:
    """The environment CMD runs with, on top of the provider's own."""
    return {
        **request.env,
        "ROBUSTRL_PROVISION_REQUEST_ID": request.request_id,
        "ROBUSTRL_PROVISION_ROLE": ROLE_FROM_PROTO.get(request.role, ""),
        "ROBUSTRL_PROVISION_INSTANCE_ID": request.instance_id,
        "ROBUSTRL_PROVISION_JOB": request.job_id,
        "ROBUSTRL_PROVISION_STANDBY": "true" if request.standby else "false",
        "ROBUSTRL_PROVISION_REASON": request.reason,
        "ROBUSTRL_PROVISION_ARGV": shlex.join(request.argv),
    }


async def fulfil(
    request: provisioning_pb2.ProvisionRequest, command: str, timeout: float
) -> provisioning_pb2.ProvisionReport:
    """Run `command` for one request; its outcome as a report."""
    proc = await asyncio.create_subprocess_shell(
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **request_env(request)},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # the shell we started, by its pid
        await proc.wait()
        return provisioning_pb2.ProvisionReport(
            request_id=request.request_id, ok=False, error=f"the command ran past {timeout:g}s"
        )
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode == 0:
        return provisioning_pb2.ProvisionReport(
            request_id=request.request_id, ok=True, detail=lines[-1][:500] if lines else ""
        )
    return provisioning_pb2.ProvisionReport(
        request_id=request.request_id,
        ok=False,
        error=f"exit {proc.returncode}: {err.decode(errors='replace').strip()[-500:]}",
    )


async def serve_requests(
    coordinator: CoordinatorClient,
    command: str,
    *,
    name: str,
    roles: Sequence[str],
    timeout: float = 120.0,
    reconnect_s: float = 1.0,
) -> None:
    """Serve the leader's requests until cancelled, following leadership as it moves."""
    hello = provisioning_pb2.ProvisionerHello(
        name=name, roles=[ROLE_TO_PROTO[role] for role in roles]
    )
    while True:
        leader = await coordinator.leader()
        if leader is None:
            log.info("provider.no_leader")
        else:
            try:
                await _session(leader["address"], hello, command, timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in FATAL:
                    raise ProviderError(f"{exc.code().name}: {exc.details()}") from exc
                log.warning("provider.stream_lost", leader=leader["address"], error=exc.details())
        await asyncio.sleep(reconnect_s)


async def _session(
    address: str, hello: provisioning_pb2.ProvisionerHello, command: str, timeout: float
) -> None:
    outgoing: asyncio.Queue[provisioning_pb2.ProvisionerMessage] = asyncio.Queue()
    outgoing.put_nowait(provisioning_pb2.ProvisionerMessage(hello=hello))

    async def messages() -> AsyncIterator[provisioning_pb2.ProvisionerMessage]:
        while True:
            yield await outgoing.get()

    async def handle(request: provisioning_pb2.ProvisionRequest) -> None:
        role = ROLE_FROM_PROTO.get(request.role, "?")
        log.info(
            "provider.request", request=request.request_id, role=role, member=request.instance_id
        )
        report = await fulfil(request, command, timeout)
        log.info("provider.report", request=request.request_id, ok=report.ok, error=report.error)
        outgoing.put_nowait(provisioning_pb2.ProvisionerMessage(report=report))

    tasks: set[asyncio.Task[None]] = set()
    async with grpc.aio.insecure_channel(address) as channel:
        # A long-lived stream: no deadline; it ends when the leader or the channel goes.
        call = provisioning_pb2_grpc.ProvisioningStub(channel).Provision(messages())
        accepted = dict(await call.initial_metadata() or ())
        if ACCEPTED_METADATA_KEY in accepted:
            log.info("provider.connected", leader=address, name=hello.name)
        try:
            async for request in call:
                task = asyncio.create_task(handle(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
