"""ServiceRuntime.crash, in a process of its own (it ends the process)."""

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
