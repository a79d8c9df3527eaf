"""What a trainer loads for a job: the latest checkpoint of that job, and never one of an
earlier job that had the same id (real model, real checkpoint files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from robustrl.contracts.binding import FIRST_EPOCH
from robustrl.contracts.jobspec import JobSpec, ModelSpec
from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from services.trainer import checkpoint
from services.trainer.config import TrainerSettings
from services.trainer.worker import TrainerWorker


def worker(runtime: ServiceRuntime, runs: Path, model_dir: Path, epoch: int) -> TrainerWorker:
    settings = TrainerSettings(instance_id="trainer-l", runs_dir=str(runs))
    spec = JobSpec(name="same", model=ModelSpec(path=str(model_dir)))
    return TrainerWorker(runtime, settings, job_id="same", epoch=epoch, spec=spec)


def checkpoint_at(trainer: TrainerWorker, step: int) -> None:
    assert trainer.checkpoints is not None and trainer.trainer is not None
    trainer.checkpoints.save(
        checkpoint.to_host(trainer.model, trainer.trainer.optimizer, step, None, {"job_id": "same"})
    )
    trainer.checkpoints.close()


async def test_a_first_trainer_sets_an_earlier_jobs_run_aside_and_a_replacement_restores(
    etcd_settings: EtcdSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An earlier job with this id left a checkpoint at step 7. The new job's first trainer
    (FIRST_EPOCH) starts at step 0 and keeps the earlier folder, renamed; it used to restore
    step 7, and that job then trained nothing. A replacement (a later epoch) restores the new
    job's own checkpoint, once it has claimed the folder for its epoch."""
    runs = tmp_path / "runs"
    runtime = ServiceRuntime(
        "trainer", TrainerSettings(instance_id="trainer-l"), etcd_settings, service_names=[]
    )
    await runtime.start()
    try:
        loads_only_its_own_jobs_run(runtime, runs, tiny_model_dir, monkeypatch)
    finally:
        await runtime.shutdown()


def loads_only_its_own_jobs_run(
    runtime: ServiceRuntime, runs: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = worker(runtime, runs, tiny_model_dir, FIRST_EPOCH)
    earlier.load()
    checkpoint_at(earlier, 7)
    (runs / "same" / "metrics.jsonl").write_text('{"step": 7}\n')

    first = worker(runtime, runs, tiny_model_dir, FIRST_EPOCH)
    first.load()

    assert (first.step, first.restored_step) == (0, 0)
    [aside] = [p for p in runs.iterdir() if p.name.startswith("same.earlier-")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 7}\n'
    assert checkpoint.load_latest(aside / "checkpoints").step == 7  # type: ignore[union-attr]

    checkpoint_at(first, 3)
    (runs / "same" / "metrics.jsonl").write_text('{"step": 3}\n')
    replacement = worker(runtime, runs, tiny_model_dir, FIRST_EPOCH + 1)
    # `first` appends a line and is frozen right after it found itself still the owner; the
    # replacement claims the folder and restores meanwhile, then `first` resumes.
    assert first.checkpoints is not None
    checked = first.checkpoints.ensure_owner

    def frozen_after_the_check() -> None:
        checked()
        replacement.load()

    monkeypatch.setattr(first.checkpoints, "ensure_owner", frozen_after_the_check)
    first.run_logs.append("metrics.jsonl", {"step": 4})
    monkeypatch.undo()
    assert (runs / "same" / "metrics.jsonl").read_text() == '{"step": 3}\n', "its line landed"
    assert (replacement.step, replacement.restored_step) == (3, 3)
    assert len(list(runs.iterdir())) == 2
    # It claimed the folder for its epoch before it read `latest`: the writer of `first`
    # (fenced) publishes nothing more (tests/unit/test_checkpoint.py).
    assert checkpoint.owner_epoch(runs / "same" / "checkpoints") == FIRST_EPOCH + 1
    # Nor does it add to the run's logs, which the replacement kept only up to step 3.
    with pytest.raises(checkpoint.Superseded):
        first.run_logs.append("metrics.jsonl", {"step": 4})  # as its metrics and audit lines go
    assert (runs / "same" / "metrics.jsonl").read_text() == '{"step": 3}\n'


async def test_a_replacement_of_a_trainer_that_died_before_its_first_checkpoint_starts_clean(
    etcd_settings: EtcdSettings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The first trainer logged its evaluation and two steps, then died before a checkpoint.
    Its replacement trains from step 0 again, so the run's logs start again with it: they
    used to keep the first trainer's lines, and the replacement's step 0 came after them."""
    runs = tmp_path / "runs"
    runtime = ServiceRuntime(
        "trainer", TrainerSettings(instance_id="trainer-l"), etcd_settings, service_names=[]
    )
    await runtime.start()
    try:
        first = worker(runtime, runs, tiny_model_dir, FIRST_EPOCH)
        first.load()
        for step in (0, 1, 2):
            first.run_logs.append("metrics.jsonl", {"step": step})
        for step in (0, 1):
            first.run_logs.append("trained.jsonl", {"step": step})

        replacement = worker(runtime, runs, tiny_model_dir, FIRST_EPOCH + 1)
        replacement.load()
        assert (replacement.step, replacement.restored_step) == (0, 0)
        assert (runs / "same" / "metrics.jsonl").read_text() == ""
        assert (runs / "same" / "trained.jsonl").read_text() == ""
        assert checkpoint.load_latest(runs / "same" / "checkpoints") is None
    finally:
        await runtime.shutdown()
