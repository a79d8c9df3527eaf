"""Processes on this host, as /proc shows them."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie awaiting its reaping has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0] not in ("Z", "X")
