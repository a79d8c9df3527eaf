"""The layers of docs/layout.md hold, and the check that holds them (`make lint`'s
lint-imports, contracts in pyproject.toml) fails when a forbidden import is added."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The packages and their contracts, copied where a test may break them."""
    for package in ("robustrl", "services"):
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(module: Path, statement: str) -> None:
    module.write_text(module.read_text() + f"\n{statement}\n")


def test_the_repository_keeps_every_contract() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "statement", "broken"),
    [
        (
            "services/coordinator/jobs.py",
            "import services.monitor.detectors",
            "no service imports another BROKEN",
        ),
        (
            "services/trainer/intake.py",
            "import services.rollout.worker",
            "no service imports another BROKEN",
        ),
        ("robustrl/core/aio.py", "import services.trainer.grpo", "v1 BROKEN"),
        ("robustrl/contracts/ids.py", "import robustrl.core.logs", "v1 BROKEN"),
        ("robustrl/weights/transport.py", "import robustrl.generation.tasks", "v1 BROKEN"),
        ("robustrl/cli/formatting.py", "import services.coordinator.work", "v1 BROKEN"),
        (
            "services/monitor/detectors.py",
            "import torch",
            "the control plane never imports the model stack BROKEN",
        ),
    ],
)
def test_a_forbidden_import_breaks_the_check(
    copy: Path, module: str, statement: str, broken: str
) -> None:
    assert lint_imports(copy).returncode == 0  # the copy itself is clean

    add_import(copy / module, statement)

    result = lint_imports(copy)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout
