"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_stack import REPO


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, made once by the repo's own command (seeded, so the same every run)."""
    out = tmp_path_factory.mktemp("model") / "tiny-qwen"
    subprocess.run(
        [sys.executable, "-m", "services.cli.main", "model", "init", "--out", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out
