"""The stack the chaos files' tests share: one per file, as `up` starts it by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cli import Cli
from tests.support.detection import detection_stack
from tests.support.recovery import cancel_unfinished


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """Made when the file's first test that asks for it runs (those tests come last in their
    file, so no other stack of the file runs beside it), `down` after the file's last test."""
    with detection_stack(tmp_path_factory.mktemp("shared")) as cli:
        yield cli


@pytest.fixture
def stack(shared_stack: Cli) -> Iterator[Cli]:
    """The shared stack for one test; a job the test left running (it failed) is cancelled,
    so that it holds no member the next test's job needs."""
    yield shared_stack
    cancel_unfinished(shared_stack)
