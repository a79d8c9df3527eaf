"""Ranks 1..N-1 as processes: rank 0 starts them (`python -m services.trainer.follower`) with
its settings, and stops by pid those that do not exit when told."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.logs import get_logger

log = get_logger(__name__)


def follower_instance_id(leader_instance_id: str, rank: int) -> str:
    return f"{leader_instance_id}-rank{rank}"


def spawn_followers(
    *,
    job_id: str,
    world_size: int,
    master: str,
    spec_path: Path,
    etcd: EtcdSettings,
    instance_id: str,
    settings: ServiceSettings | None = None,
    torch_threads: int = 1,
    timeout_s: float = 300.0,
    extra_args: Mapping[int, Sequence[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..world_size-1 as `python -m services.trainer.follower` processes.

    Each gets etcd's settings and this trainer's service settings (heartbeat interval, log
    format, hosts) as ROBUSTRL_* env, the instance id `<instance_id>-rank<r>`, a port of its
    own choosing, and this process's pid, so it exits if rank 0 goes away.
    `extra_args[r]` is appended to rank r's command line (failure injection in tests).
    """
    env = dict(os.environ)
    env.update(
        {
            "ROBUSTRL_ETCD_ENDPOINTS": etcd.endpoints,
            "ROBUSTRL_ETCD_PREFIX": etcd.prefix,
            "ROBUSTRL_ETCD_SESSION_TTL": str(etcd.session_ttl),
            "ROBUSTRL_ETCD_TIMEOUT": str(etcd.timeout),
            "ROBUSTRL_TRAINER_PORT": "0",
            "ROBUSTRL_TRAINER_TORCH_THREADS": str(torch_threads),
        }
    )
    if settings is not None:
        for name in (
            "bind_host",
            "advertise_host",
            "epoch",
            "heartbeat_interval",
            "shutdown_grace",
            "log_format",
            "log_level",
        ):
            env[f"ROBUSTRL_TRAINER_{name.upper()}"] = str(getattr(settings, name))
    procs = []
    for rank in range(1, world_size):
        env["ROBUSTRL_TRAINER_INSTANCE_ID"] = follower_instance_id(instance_id, rank)
        command = [
            sys.executable,
            "-m",
            "services.trainer.follower",
            f"--job={job_id}",
            f"--rank={rank}",
            f"--world-size={world_size}",
            f"--master={master}",
            f"--spec={spec_path}",
            f"--timeout={timeout_s}",
            f"--parent-pid={os.getpid()}",
            *(extra_args or {}).get(rank, ()),
        ]
        procs.append(subprocess.Popen(command, env=dict(env)))
        log.info("trainer.follower_started", job=job_id, rank=rank, pid=procs[-1].pid)
    return procs


def stop_followers(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for the followers to exit, then stop the rest by pid.

    Only these processes are signalled. A stopped (SIGSTOP) one is continued so that it
    sees the SIGTERM; one that ignores that is killed. Returns their exit codes.
    """
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            log.warning("trainer.follower_stopped", pid=proc.pid)
            proc.terminate()
            proc.send_signal(signal.SIGCONT)
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [int(proc.returncode) for proc in procs]
