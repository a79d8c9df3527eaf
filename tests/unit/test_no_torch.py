"""coordinator and monitor (and the CLI) must import and start without torch installed."""

from __future__ import annotations

import subprocess
import sys

BLOCK_AND_IMPORT = """
import importlib.abc, sys

class NoModelStack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "vllm", "ucxx", "numpy"}:
            raise ImportError(f"{name} is not installed in this image")
        return None

sys.meta_path.insert(0, NoModelStack())
import services.coordinator, services.coordinator.server, services.coordinator.__main__
import services.monitor, services.monitor.server, services.monitor.__main__
import robustrl.cli.main
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "transformers", "numpy"})
assert not heavy, heavy
print("ok")
"""


def test_control_plane_imports_without_the_model_stack() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_IMPORT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
