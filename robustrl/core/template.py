"""The warm template: one process that has imported the trainer's and the rollout's libraries
once, and forks each member the local stack or the local provisioner starts.

A member started as a fresh interpreter spends 5-9 s of a core importing torch, transformers
and our services before it does anything of its own; on the local stack that core is one the
job runs on (decisions 0307, 0023). A forked child has them imported already, and shares their
pages with the template until it writes to them.

    python -m robustrl.core.template [--stay] SOCKET MODULE...

imports each MODULE, then serves on the Unix socket SOCKET. A request is one JSON line,
{"module": "services.rollout", "env": {...}, "log": "/path/member.log", "args": [...]}; the
reply is one JSON line, {"pid": N, "argv": [...]}. Only a preloaded module, or a package above
one, is run. A request that comes with three file descriptors (SCM_RIGHTS) gets them as the
child's stdin, stdout and stderr instead of /dev/null and the log. The child starts a session
of its own, takes exactly the environment asked for and runs the module with `args` as
`python -m` would; the kernel
reaps it (the template ignores SIGCHLD), so the template holds no child state. The template
exits on SIGTERM, and, without --stay, once the process that started it has gone (a
coordinator's own template); `robustrl up` starts one with --stay and `down` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

from robustrl.core.logs import get_logger

log = get_logger(__name__)

_ACCEPT_POLL_S = 1.0
"""How often the template looks whether the process that started it is still there."""

PRELOAD = ("services.trainer.server", "services.rollout.server")
"""What a template imports: the member's whole library stack (torch, transformers, ours)."""


class TemplateRefused(RuntimeError):
    """The template answered a fork request with an error (a bad request, fork failed)."""


def request_fork(
    socket_path: str | Path,
    module: str,
    env: dict[str, str],
    log_path: str | Path = "",
    *,
    args: tuple[str, ...] = (),
    stdio: tuple[int, int, int] | None = None,
) -> tuple[int, list[str]]:
    """Ask the template at `socket_path` to fork `python -m <module> <args>`: its pid and its
    command line (the template's). Its output goes to `log_path`, or, with `stdio`, it gets
    those descriptors as its stdin, stdout and stderr. OSError or TimeoutError where nothing
    answers, TemplateRefused where it refuses: the caller then starts the member fresh."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10.0)
        conn.connect(str(socket_path))
        request = {"module": module, "env": env, "log": str(log_path), "args": list(args)}
        payload = json.dumps(request).encode() + b"\n"
        sent = socket.send_fds(conn, [payload], list(stdio)) if stdio else 0
        if sent < len(payload):  # an empty send after the template answered is EPIPE
            conn.sendall(payload[sent:])
        line = conn.makefile("rb").readline()
    try:
        reply = json.loads(line)
    except ValueError as exc:
        raise TemplateRefused(f"unreadable reply {line[:200]!r}") from exc
    if "pid" not in reply:
        raise TemplateRefused(str(reply.get("error", reply)))
    return int(reply["pid"]), [str(arg) for arg in reply["argv"]]


def new_socket_path() -> Path:
    """A socket path in a fresh directory of its own: short (the AF_UNIX path limit), and
    removed whole with its directory once the template is stopped."""
    return Path(tempfile.mkdtemp(prefix="robustrl-tpl-")) / "fork.sock"


def template_argv(
    socket_path: str | Path, preload: tuple[str, ...] = PRELOAD, *, stay: bool = False
) -> list[str]:
    """The command line of a template serving on `socket_path`."""
    stays = ["--stay"] if stay else []
    return [sys.executable, "-m", "robustrl.core.template", *stays, str(socket_path), *preload]


async def _ask(
    socket_path: Path, module: str, env: dict[str, str], log_path: Path
) -> tuple[int, list[str]] | None:
    """`request_fork` off the event loop; None (logged) where the template does not fork."""
    try:
        return await asyncio.to_thread(request_fork, socket_path, module, env, log_path)
    except (OSError, TimeoutError) as exc:
        log.warning("provision.template_unanswered", error=repr(exc)[:200])
    except TemplateRefused as exc:
        log.warning("provision.template_refused", error=str(exc)[:500])
    return None


class AttachedTemplate:
    """The provisioner's side of a template it did not start (the stack's, `robustrl up`'s):
    it neither starts nor stops it, and a fork it does not answer starts the member fresh."""

    pid = None
    ready = True
    """Forks at once: the stack started its members from it, so it serves, or is gone."""

    def __init__(self, socket_path: str | Path) -> None:
        self.socket_path = Path(socket_path)
        self._gone_logged = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def fork(
        self, module: str, env: dict[str, str], log_path: Path
    ) -> tuple[int, list[str]] | None:
        """As WarmTemplate.fork."""
        if not self.socket_path.exists():
            if not self._gone_logged:
                self._gone_logged = True
                log.warning("provision.template_gone", socket=str(self.socket_path))
            return None
        return await _ask(self.socket_path, module, env, log_path)


class WarmTemplate:
    """The provisioner's side of a template of its own: starts it, asks it to fork members.

    A member asked for while the template is still importing waits for it, up to
    `ready_wait_s`: a fresh interpreter would spend that time on the same imports, and the
    cores once more. `fork` answers None where the template is gone or did not get ready in
    time: the caller then starts the member fresh. `ready` says whether `fork` answers at
    once (a caller that must not wait runs it in the background otherwise).
    """

    def __init__(
        self, log_dir: Path, preload: tuple[str, ...] = PRELOAD, ready_wait_s: float = 30.0
    ) -> None:
        self.log_dir = log_dir
        self.preload = preload
        self.ready_wait_s = ready_wait_s
        self.socket_path = new_socket_path()
        self._proc: asyncio.subprocess.Process | None = None
        self._gone_logged = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def ready(self) -> bool:
        """Forks at once: up and serving, or gone (the member then starts fresh at once)."""
        proc = self._proc
        return proc is not None and (proc.returncode is not None or self.socket_path.exists())

    async def fork(
        self, module: str, env: dict[str, str], log_path: Path
    ) -> tuple[int, list[str]] | None:
        """`python -m <module>` forked from the template: its pid and its command line (the
        template's: what /proc shows and `robustrl down` checks before it stops a pid). None:
        start it fresh."""
        if not await self._ready():
            return None
        return await _ask(self.socket_path, module, env, log_path)

    async def _ready(self) -> bool:
        proc = self._proc
        assert proc is not None, "start() the template first"
        deadline = time.monotonic() + self.ready_wait_s
        while not self.socket_path.exists() and proc.returncode is None:
            if time.monotonic() > deadline:
                log.warning("provision.template_slow", waited_s=self.ready_wait_s)
                return False
            await asyncio.sleep(0.05)
        if proc.returncode is not None:
            if not self._gone_logged:
                self._gone_logged = True
                log.warning("provision.template_gone", returncode=proc.returncode)
            return False
        return True

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_dir / "template.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *template_argv(self.socket_path, self.preload),
                stdout=fd,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            os.close(fd)
        log.info("provision.template_started", pid=self._proc.pid, socket=str(self.socket_path))

    async def close(self) -> None:
        """Stop the template (members it forked go on: each is a session of its own)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)


def serve(socket_path: str, preload: list[str], stay: bool = False) -> int:
    """`stay`: serve until SIGTERM, not only while the process that started it lives."""
    parent = os.getppid()
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the children never walk (nor touch the pages of) what is imported here
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    listener.settimeout(_ACCEPT_POLL_S)
    print(f"template.ready socket={socket_path} preloaded={','.join(preload)}", flush=True)
    runnable = tuple(preload)
    try:
        while stay or os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10.0)
                reply: dict[str, object]
                fds: list[int] = []
                try:
                    request, fds = _read_request(conn)
                    # The child's command line is the template's (fork does not change it).
                    pid = _fork(request, fds, runnable, listener, conn)
                    reply = {"pid": pid, "argv": sys.orig_argv}
                except Exception as exc:  # a bad request costs that request only
                    reply = {"error": repr(exc)[:500]}
                finally:
                    for fd in fds:
                        os.close(fd)  # the child has its copies
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)
    return 0


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request line, and the descriptors that came with it (none, or stdin, stdout and
    stderr for the child)."""
    data, fds, _flags, _address = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    try:
        request = json.loads(data)
        if fds and len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors: stdin, stdout and stderr, or none")
    except Exception:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _runs(module: str, preloaded: tuple[str, ...]) -> bool:
    """Whether the template runs `module`: one it preloaded, or a package above one."""
    return any(name == module or name.startswith(module + ".") for name in preloaded)


def _fork(
    request: dict[str, Any],
    fds: list[int],
    preloaded: tuple[str, ...],
    listener: socket.socket,
    conn: socket.socket,
) -> int:
    module, env, log = str(request["module"]), dict(request["env"]), str(request.get("log", ""))
    args = [str(arg) for arg in request.get("args", [])]
    if not _runs(module, preloaded):
        raise ValueError(f"{module!r} is neither preloaded nor a package above one")
    if fds:
        stdio = (fds[0], fds[1], fds[2])
    elif log:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        stdio = (os.open(os.devnull, os.O_RDONLY), out, out)
    else:
        raise ValueError("neither a log nor stdin, stdout and stderr")
    opened = () if fds else set(stdio)  # the template's own: serve() closes the sent ones
    try:
        pid = os.fork()
    except OSError:
        for fd in opened:
            os.close(fd)
        raise
    if pid:
        for fd in opened:
            os.close(fd)
        print(f"template.forked module={module} pid={pid} log={log}", flush=True)
        return pid
    _become(module, args, env, stdio, listener, conn)  # never returns


def _become(
    module: str,
    args: list[str],
    env: dict[str, str],
    stdio: tuple[int, int, int],
    listener: socket.socket,
    conn: socket.socket,
) -> NoReturn:
    """In the child: the member `python -m <module> <args>` with `env` would be."""
    code = 1
    try:
        listener.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()  # outlives the coordinator, as a member started fresh does
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        # What an interpreter reads from the environment as it starts and the template read
        # from its own: the member's output buffering (its logs are followed as it runs).
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(write_through=bool(env.get("PYTHONUNBUFFERED")))
        sys.argv = [module, *args]
        # runpy warns where the module it runs as __main__ is imported already, as the
        # template imported it: the member runs it afresh all the same.
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    args = sys.argv[1:]
    stay = bool(args) and args[0] == "--stay"
    args = args[1:] if stay else args
    if not args:
        sys.exit("usage: python -m robustrl.core.template [--stay] SOCKET MODULE...")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    code = 0
    try:
        code = serve(args[0], args[1:], stay)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: the preloaded libraries only complain in it
