"""Running a benchmark script to its end, as a test of the benchmark itself."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO


def run_benchmark(
    script: str, *args: str, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """benchmarks/<script> run to the end with this interpreter, from the repository root."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
