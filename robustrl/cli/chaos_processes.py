"""What `robustrl chaos` needs to know of a member's processes on this host: whether it can
signal them, the engine process of a rollout, a pid's parent and start time (from /proc)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from robustrl.contracts.members import ENGINE_PID_LABEL, MemberRecord


def local_problem(member: MemberRecord, hostname: str | None = None) -> str | None:
    """Why this member's process cannot be signalled from here; None if it can."""
    hostname = hostname or socket.gethostname()
    if member.host != hostname:
        return (
            f"{member.instance_id} runs on {member.host}, not on this host ({hostname}); "
            "chaos signals local processes only"
        )
    try:
        argv = Path(f"/proc/{member.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{member.instance_id}: no process {member.pid} on this host"
    if not argv or b"python" not in Path(argv[0].decode(errors="replace")).name.encode():
        return f"{member.instance_id}: pid {member.pid} is not a python process here"
    if member.pid == os.getpid():
        return f"{member.instance_id}: pid {member.pid} is this command"
    return None


def engine_process(member: MemberRecord) -> tuple[int, str | None]:
    """The member's engine process (its `engine_pid` label), and why it cannot be signalled
    from here (None if it can): it must be a child of the member's process on this host."""
    problem = local_problem(member)
    label = member.labels.get(ENGINE_PID_LABEL, "")
    if problem is not None:
        return 0, problem
    if not label.isdigit():
        return 0, (
            f"{member.instance_id} runs its engine in its own process (rollout.engine: torch); "
            "only a vLLM engine can be signalled alone"
        )
    pid = int(label)
    if parent_of(pid) != member.pid:
        return pid, f"{member.instance_id}: pid {pid} is not its engine process (anymore)"
    return pid, None


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[-1].split()[1])


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


# ----------------------------------------------------------------------------- running
