"""ServiceRuntime.crash and long_lived_objects, each in a process of its own (one ends the
process, the other changes its garbage collector for good)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.common.runtime import CRASH_EXIT

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
from services.common.config import EtcdSettings, ServiceSettings
from services.common.runtime import ServiceRuntime
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
from services.common.runtime import long_lived_objects

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
