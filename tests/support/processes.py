"""Processes a test started: their state in /proc, and SIGSTOP for a block."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from tests.support.waiting import eventually_sync


def process_state(pid: int, thread: int | None = None) -> str:
    """The state letter in /proc (R, S, T for stopped, Z for a zombie, ...) of pid, or of one
    of its threads."""
    stat = Path(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat")
    return stat.read_text().rsplit(")", 1)[-1].split()[0]


def exited(pid: int) -> bool:
    """Gone, or exited and not reaped yet (a zombie)."""
    try:
        return process_state(pid) == "Z"
    except FileNotFoundError:
        return True


def parent_of(pid: int) -> int:
    """The parent pid /proc shows for pid."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP pid and return once every thread of it is stopped.

    kill() returns before the stop has happened: the process stops only when one of its
    threads next runs and starts the group stop. On a loaded host its other threads go on for
    milliseconds meanwhile (measured: etcd answered a request sent 0.1 ms after the signal),
    which a test that acts on "etcd is stopped" must not mistake for the code under test."""
    os.kill(pid, signal.SIGSTOP)
    states: list[str] = []

    def every_thread_stopped() -> bool:
        states.clear()
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(process_state(pid, int(task.name)))
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
        return bool(states) and all(state in ("T", "t") for state in states)

    eventually_sync(
        every_thread_stopped,
        timeout,
        interval=0.001,
        unmet=lambda: f"pid {pid} not stopped {timeout}s after SIGSTOP: {states}",
    )


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """pid stopped (`stop_process`) for the block, and continued after it, whatever happens."""
    stop_process(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def thread_niceness(pid: int) -> set[int]:
    """The niceness of each thread of pid, as a set: {n} when every thread runs at n."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            found.add(os.getpriority(os.PRIO_PROCESS, int(task.name)))
    return found
