"""Processes on this host, as /proc shows them."""

from __future__ import annotations

import os
import resource
from pathlib import Path

CAP_SYS_NICE = 23
"""The capability's bit in /proc/<pid>/status CapEff (linux/capability.h)."""


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie awaiting its reaping has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, breadth first (from /proc's children lists)."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    frontier.append(child)
    return found


def process_name(pid: int) -> str:
    """The process's name (/proc/<pid>/comm; vLLM names its own VLLM::...), '' if gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def set_niceness(pid: int, niceness: int) -> int:
    """Give every thread of `pid` and of the processes below it this niceness (Linux keeps it
    per thread, and a thread or process inherits its creator's). Returns how many threads
    changed; threads and processes that exit meanwhile are passed over. PermissionError where
    the niceness is lower than a thread's and the caller may not raise priority
    (`may_raise_priority`)."""
    changed = 0
    for proc in (pid, *descendants(pid)):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                continue
            changed += 1
    return changed


def may_raise_priority(niceness: int) -> bool:
    """Whether this process may set a thread's niceness back down to `niceness`: with
    CAP_SYS_NICE, or within RLIMIT_NICE (which allows down to 20 - its soft limit)."""
    try:
        status = Path("/proc/self/status").read_text()
        effective = int(
            next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16
        )
    except (OSError, StopIteration, ValueError):
        effective = 0
    if effective & (1 << CAP_SYS_NICE):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= niceness
