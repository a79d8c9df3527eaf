"""Shared fixtures (a real etcd process, per-test key namespaces, the test model) and the
run's own rules: test files ordered longest first from tests/durations.json, and under
`CI=true` a skipped test that needs no GPU fails the run."""

from __future__ import annotations

import asyncio
import asyncio.runners
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from robustrl.core.config import EtcdSettings
from tests.support.etcd import EtcdProcess, started_etcd
from tests.support.loops import cancel_all_tasks_or_name_the_stuck


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # One OpenMP thread for torch in the test processes and what they start (the services set
    # theirs from torch_threads, 1 by default): with two workers on two cores, torch's default
    # of a thread a core spins for its peers, ten times the CPU for the same work (decision 0022).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    asyncio.runners._cancel_all_tasks = cancel_all_tasks_or_name_the_stuck  # type: ignore[attr-defined]


ON_CUDA_WHEN_THERE = ("test_vllm_engine.py",)
"""Suites that run on whatever device the host has: on a CUDA host they are `gpu` tests too
(`pytest -m gpu` runs them there), on a CPU host they run with the CPU tests."""


DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test file took in a full run (`make durations` writes it): files are run
longest first, so that with `--dist loadfile` the two workers finish together instead of one
starting the longest file last."""

WRITE_DURATIONS_ENV = "ROBUSTRL_WRITE_DURATIONS"
"""A path: the run writes each file's seconds there as it ends (what `make durations` sets)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = _cuda_available()
    for item in items:
        if has_gpu and item.path.name in ON_CUDA_WHEN_THERE:
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    # A file not in the list (new) goes first: its time is unknown, so it is not left to last.
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), float("inf")))


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    # In CI a skip would be a test counted green that checked nothing: only the tests that
    # need a GPU may skip there (CI has none).
    if (
        _in_ci()
        and report.skipped
        and "gpu" not in item.keywords
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} skipped under CI=true ({reason}): a test that needs no GPU must run "
            "in CI; make what it needs available instead of skipping"
        )


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = _file_of(report.nodeid)
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(WRITE_DURATIONS_ENV)
    if target and _file_seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
        ordered = dict(sorted(_file_seconds.items(), key=lambda kv: -kv[1]))
        Path(target).write_text(
            json.dumps({k: round(v, 1) for k, v in ordered.items()}, indent=1) + "\n"
        )


def _cuda_available() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of this test's own, for tests that stop or kill it."""
    server = started_etcd(tmp_path / "etcd")
    yield server
    with contextlib.suppress(ProcessLookupError):
        server.proc.send_signal(signal.SIGCONT)
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One real etcd for the whole run; tests isolate themselves by key prefix."""
    server = started_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def etcd_settings(etcd_server: EtcdProcess) -> EtcdSettings:
    """Settings pointing at the shared etcd with a namespace of this test's own."""
    return EtcdSettings(
        endpoints=etcd_server.endpoints, prefix=f"/t-{uuid.uuid4().hex[:10]}", session_ttl=2
    )


@pytest.fixture
async def etcd_client(etcd_settings: EtcdSettings) -> AsyncIterator[object]:
    from robustrl.core.etcd_client import connect_etcd

    client = await connect_etcd(etcd_settings)
    yield client
    await client.close()


TEST_MODEL_ENV = "ROBUSTRL_TEST_MODEL"
"""The tiny model made before the run (`make test` builds it once, off every test's clock);
unset, the first test that needs it makes it."""
TEST_LIKE_MODEL_ENV = "ROBUSTRL_TEST_LIKE_MODEL"
"""The same for LIKE_MODEL, the checkpoint shaped like a release."""
LIKE_MODEL = ("qwen2.5-0.5b", 2)
"""The real-shaped checkpoint of the tests: Qwen2.5-0.5B's architecture, bf16, tied, a
151,936-token vocabulary and a chat template, cut to 2 layers (`model init --like`)."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, made once per run by the repo's own command (seeded, so the same every
    run). Read-only."""
    return _made_once(tmp_path_factory, TEST_MODEL_ENV, "tiny-qwen", [])


@pytest.fixture(scope="session")
def like_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LIKE_MODEL, made once per run by the repo's own command. Read-only."""
    name, layers = LIKE_MODEL
    return _made_once(
        tmp_path_factory, TEST_LIKE_MODEL_ENV, name, ["--like", name, "--layers", str(layers)]
    )


def _made_once(
    tmp_path_factory: pytest.TempPathFactory, env: str, name: str, options: list[str]
) -> Path:
    """`robustrl model init OPTIONS` once per run, or the copy `env` names. Under
    pytest-xdist the workers share one copy: the first to get here makes it in the run's
    common folder, the others wait on the lock and use it."""
    prebuilt = os.environ.get(env)
    if prebuilt:
        made = Path(prebuilt)
        assert (made / "config.json").exists(), f"{env}={prebuilt} holds no model"
        return made
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, made = root / "model" / name, root / "model" / f"{name}.made"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed left
            init = [sys.executable, "-m", "robustrl.cli.main", "model", "init", "--out", str(out)]
            subprocess.run(
                [*init, *options],
                cwd=Path(__file__).resolve().parents[1],
                check=True,
                capture_output=True,
                timeout=600,
            )
            made.touch()
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smallest model (tests/unit/tiny_model.py's TINY, seed 0), made once in-process, for
    the engine, GRPO and trainer-rank tests. Read-only: a test that changes it makes a copy."""
    import torch

    from robustrl.generation.modelgen import init_model
    from tests.support.tiny_model import TINY

    torch.set_num_threads(1)
    return init_model(tmp_path_factory.mktemp("tiny"), seed=0, shape=TINY)
