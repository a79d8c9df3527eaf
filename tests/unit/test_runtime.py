"""ServiceRuntime.crash, long_lived_objects, aio.run_process and default instance ids, each in a
process of its own (they end the process, change its garbage collector for good, leave a task
behind, or are drawn once per process)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from robustrl.core.runtime import CRASH_EXIT

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.runtime import ServiceRuntime
runtime = ServiceRuntime("rollout", ServiceSettings(), EtcdSettings(), service_names=[])
runtime.crash("generate-j failed")
print("still running")
"""


def test_a_crash_ends_the_process_at_once_with_its_status_and_says_why() -> None:
    # No goodbye and no deregistration (nothing after it runs): it ends as a kill would.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    output = done.stdout + done.stderr
    assert done.returncode == CRASH_EXIT, output
    assert "still running" not in output
    assert "rollout.crashed" in output and "generate-j failed" in output


FREEZE_SCRIPT = """
import gc
from robustrl.core.runtime import long_lived_objects

with long_lived_objects():  # no main started it: a block that runs as it is
    kept = [[] for _ in range(1000)]
assert gc.get_freeze_count() == 0 and gc.isenabled()

with long_lived_objects(start=True):
    assert not gc.isenabled()  # no collection while the block makes what it keeps
    kept = [[] for _ in range(1000)]
    cycle = []
    cycle.append(cycle)
    del cycle
frozen = gc.get_freeze_count()
assert gc.isenabled() and frozen > 1000, frozen
assert gc.collect() == 0  # the cycle was collected before the freeze, not frozen with it

with long_lived_objects():  # once a main started, later blocks freeze too (a model load)
    more = [[] for _ in range(1000)]
assert gc.get_freeze_count() >= frozen + 1000 and gc.isenabled()
print("ok")
"""


def test_long_lived_objects_freezes_in_a_service_process_and_nowhere_else() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FREEZE_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


EXIT_SCRIPT = """
import asyncio, sys
from robustrl.core.aio import run_process

async def stubborn():
    while True:
        try:
            await asyncio.sleep(10)  # not a wait: pending when main returns, outliving the cancel
        except asyncio.CancelledError:
            continue  # as a task stuck in a call that never returns would

async def obliging():
    await asyncio.sleep(10)  # not a wait: pending when main returns, until its cancel

async def main():
    asyncio.create_task(stubborn(), name="stubborn")
    asyncio.create_task(obliging(), name="obliging")
    await asyncio.sleep(0)
    print("main returned", flush=True)
    return 3

if sys.argv[1] == "asyncio.run":
    sys.exit(asyncio.run(main()))
sys.exit(run_process(main(), stuck_wait_s=0.5))
"""


def test_a_service_process_exits_though_a_task_ignores_its_cancellation() -> None:
    # asyncio.run, as the services' mains used it, waits for ever for the stubborn task.
    try:
        subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, "asyncio.run"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
        raise AssertionError("asyncio.run exited with a task that ignores its cancellation")
    except subprocess.TimeoutExpired as exc:
        assert "main returned" in str(exc.stdout), exc.stdout

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, "run_process"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 3, output  # main's result is the process's
    assert time.monotonic() - started < 30, output
    stuck = [line for line in output.splitlines() if "process.tasks_stuck_at_exit" in line]
    assert len(stuck) == 1, output
    assert "stubborn" in stuck[0] and "obliging" not in stuck[0], output


ID_SCRIPT = """
import os
from robustrl.core.config import ServiceSettings
os.getpid = lambda: 1  # as a container's main process is, after every restart
ids = {ServiceSettings().resolved_instance_id("rollout") for _ in range(3)}
assert len(ids) == 1, ids
print(ids.pop())
print(ServiceSettings(instance_id="rollout-7").resolved_instance_id("rollout"))
"""


def test_a_default_instance_id_is_new_for_every_process_even_with_its_host_and_pid() -> None:
    # A fence names an instance id: a restarted container must not come back as the fenced one.
    runs = [
        subprocess.run(
            [sys.executable, "-c", ID_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    (first, given), (second, _) = (run.stdout.split() for run in runs)
    host = socket.gethostname()
    assert re.fullmatch(rf"rollout-{re.escape(host)}-1-[0-9a-f]{{6}}", first), first
    assert first != second
    assert given == "rollout-7"  # a given id is used as it is
