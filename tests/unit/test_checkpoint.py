"""Checkpoints restore training exactly, land atomically, and never fail silently."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    Superseded,
    capture_rng,
    claim,
    load_checkpoint,
    load_latest,
    restore,
    to_host,
    write_snapshot,
)
from services.trainer.checkpoint import folder as checkpoint_folder


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """Steps that draw from every RNG, so a wrongly restored generator changes the result."""
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4) + random.random() + float(np.random.rand())
        loss = model(torch.nn.functional.dropout(x, 0.3)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_round_trip_restores_training_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model, optimizer = _fresh(0)
    _train(model, optimizer, 3)
    extra: dict[str, Any] = {"committed": {"rollout-a": ["t1", "t2"]}, "watermark": 41}
    snapshot = to_host(model, optimizer, step=3, extra=extra)
    extra["watermark"] = 99  # later changes by the caller do not leak into the snapshot
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.save(snapshot)
    writer.close()

    expected_losses = _train(model, optimizer, 4)
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}

    # Everything scrambled: another init, no optimizer history, other RNG states.
    other, other_opt = _fresh(123)
    random.seed(5)
    np.random.seed(5)
    ckpt = load_latest(tmp_path)
    assert ckpt is not None
    assert ckpt.step == 3
    assert ckpt.extra == {"committed": {"rollout-a": ["t1", "t2"]}, "watermark": 41}
    assert restore(ckpt, other, other_opt) == 3
    assert _train(other, other_opt, 4) == expected_losses
    for k, v in other.state_dict().items():
        assert torch.equal(v, expected_state[k]), k


def test_snapshot_is_a_copy_not_a_view(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    snapshot = to_host(model, optimizer, step=1)
    frozen = {k: v.clone() for k, v in snapshot.model_state.items()}
    moments = snapshot.optimizer_state["state"][0]["exp_avg"].clone()
    _train(model, optimizer, 2)
    for k, v in snapshot.model_state.items():
        assert torch.equal(v, frozen[k])
    assert torch.equal(snapshot.optimizer_state["state"][0]["exp_avg"], moments)


def test_extra_must_be_json(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    with pytest.raises(ValueError, match="JSON"):
        to_host(model, optimizer, step=0, extra={"ids": {"a", "b"}})
    with pytest.raises(ValueError, match="JSON"):
        to_host(model, optimizer, step=0, extra={"x": float("nan")})


def test_latest_pointer_and_pruning(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    written: list[tuple[int, dict[str, Any]]] = []
    writer = CheckpointWriter(tmp_path, keep=2, on_written=lambda s, e: written.append((s, e)))
    for step in range(1, 5):
        _train(model, optimizer, 1)
        writer.save(to_host(model, optimizer, step=step, extra={"step": step}))
        writer.wait()
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3", "step-4"]
    assert (tmp_path / "latest").read_text().strip() == "step-4"
    assert writer.durable_step == 4
    assert written == [(s, {"step": s}) for s in range(1, 5)]
    meta = json.loads((tmp_path / "step-4" / "meta.json").read_text())
    assert meta == {"format": 1, "step": 4, "extra": {"step": 4}, "sharded": False}
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 4
    assert load_checkpoint(tmp_path / "step-3").step == 3


def test_nothing_written_means_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "missing") is None


def test_an_unfinished_write_is_invisible_and_cleaned_up(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    write_snapshot(tmp_path, to_host(model, optimizer, step=1), keep=3)
    # A writer that died mid-way through step 2 leaves only its temp directory.
    partial = tmp_path / ".tmp-step-2-deadbeef"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1
    CheckpointWriter(tmp_path).close()
    assert not partial.exists()


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    write_snapshot(tmp_path, to_host(model, optimizer, step=1, extra={"v": 1}), keep=3)
    write_snapshot(tmp_path, to_host(model, optimizer, step=1, extra={"v": 2}), keep=3)
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.extra == {"v": 2}


def test_a_write_error_surfaces_on_wait_and_on_the_next_save(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    target = tmp_path / "ckpt"
    writer = CheckpointWriter(target)
    shutil.rmtree(target)
    target.write_text("not a directory")  # every write into it now fails
    writer.save(to_host(model, optimizer, step=1))
    with pytest.raises(CheckpointError, match="failed"):
        writer.wait()
    # Without a wait, the failure of step 2 is reported by a later save().
    writer.save(to_host(model, optimizer, step=2))
    deadline = time.monotonic() + 10
    with pytest.raises(CheckpointError):
        while time.monotonic() < deadline:
            writer.save(to_host(model, optimizer, step=3))
            time.sleep(0.01)
    assert writer.durable_step is None
    with contextlib.suppress(CheckpointError):
        writer.wait()  # a step-3 write queued by the loop may fail too
    target.unlink()
    writer.save(to_host(model, optimizer, step=4))
    writer.close()
    assert writer.durable_step == 4


def test_a_dangling_pointer_is_an_error(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    write_snapshot(tmp_path, to_host(model, optimizer, step=1), keep=3)
    shutil.rmtree(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match="missing"):
        load_latest(tmp_path)


def test_a_corrupt_checkpoint_is_an_error(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    path = write_snapshot(tmp_path, to_host(model, optimizer, step=1), keep=3)
    assert path is not None
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_latest(tmp_path)


def test_rng_capture_restores_every_generator() -> None:
    from services.trainer.checkpoint import restore_rng

    state = capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(state)
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0])
    assert first[1:] == second[1:]


def test_writer_rejects_bad_keep(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        CheckpointWriter(tmp_path, keep=0)


def hold_fsyncs(
    monkeypatch: pytest.MonkeyPatch, writer: CheckpointWriter, at: str = ""
) -> tuple[threading.Event, threading.Event]:
    """Hold `writer`'s thread at its next fsync of a file whose name starts with `at` (a slow
    disk, or a frozen process) until the second event is set; the first is set once it is
    held."""
    held, release = threading.Event(), threading.Event()
    real_fsync = checkpoint_folder.fsync_file

    def held_fsync(path: Path) -> None:
        if threading.current_thread() is writer._thread and path.name.startswith(at):
            held.set()
            assert release.wait(10)
        real_fsync(path)

    monkeypatch.setattr(checkpoint_folder, "fsync_file", held_fsync)
    return held, release


@pytest.mark.parametrize("cleared_meanwhile", [False, True])
def test_an_abandoned_writer_publishes_nothing_and_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleared_meanwhile: bool
) -> None:
    """A fenced trainer's writer (abandon) mid-way through a slow write: the write is not
    published (no step folder, `latest` unchanged, no durable step, no callback), and closing
    raises nothing, also when its replacement cleared the unfinished write meanwhile (in a
    demo the fenced trainer's close raised FileNotFoundError, through the leader's FENCE)."""
    model, optimizer = _fresh(0)
    written: list[int] = []
    writer = CheckpointWriter(tmp_path, on_written=lambda step, _: written.append(step))
    writer.save(to_host(model, optimizer, step=1))
    writer.wait()
    slow, release = hold_fsyncs(monkeypatch, writer)
    writer.save(to_host(model, optimizer, step=2))
    assert slow.wait(10)
    writer.save(to_host(model, optimizer, step=3))  # queued behind it

    writer.abandon()
    if cleared_meanwhile:
        CheckpointWriter(tmp_path).close()  # a replacement's writer clears unfinished writes
    release.set()
    writer.close(timeout=10)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    assert writer.durable_step == 1 and written == [1]


@pytest.mark.parametrize("held_at", ["files", "pointer"])
@pytest.mark.parametrize("replacement", ["writer", "claim only"])
def test_a_writer_whose_folder_a_newer_epoch_claimed_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replacement: str, held_at: str
) -> None:
    """A fenced trainer that never heard of its fence: frozen mid-write (here a write held at
    an fsync: of its files, or of the new `latest` after its step folder was renamed into
    place), it resumes after its replacement (a newer epoch) claimed the folder and read
    `latest`. Its write is not published (it used to be, and `latest` named it), nothing of it
    is left, it raises nothing, its next save says Superseded, and an older epoch cannot claim
    the folder back. The replacement's writer also clears the unfinished writes it finds
    ("writer"); a bare claim leaves them, so the write reaches its publishing checks ("claim
    only")."""
    model, optimizer = _fresh(0)
    old = CheckpointWriter(tmp_path, epoch=1)
    old.save(to_host(model, optimizer, step=1))
    old.wait()
    held, release = hold_fsyncs(monkeypatch, old, at=".latest" if held_at == "pointer" else "")
    old.save(to_host(model, optimizer, step=2))
    assert held.wait(10)

    new = CheckpointWriter(tmp_path, epoch=2) if replacement == "writer" else None
    if new is None:
        claim(tmp_path, 2)
    restored = load_latest(tmp_path)
    assert restored is not None and restored.step == 1
    release.set()
    old.wait(timeout=10)

    # The claim pinned what epoch 2 restored from in a pointer of its own.
    names = ["latest.e1", "latest.e2", "owner", "step-1.e1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert (tmp_path / "latest.e1").read_text().strip() == "step-1.e1"
    assert (tmp_path / "latest.e2").read_text().strip() == "step-1.e1"
    assert old.durable_step == 1 and old.superseded_by == 2
    with pytest.raises(Superseded, match="owned by trainer epoch 2, newer than 1"):
        old.save(to_host(model, optimizer, step=3))
    with pytest.raises(Superseded):
        CheckpointWriter(tmp_path, epoch=1)
    old.close(timeout=10)
    if new is not None:
        new.save(to_host(model, optimizer, step=2))
        new.close(timeout=10)
        # Epoch 2's first checkpoint retires the older epoch's pointer.
        names = ["latest.e2", "owner", "step-1.e1", "step-2.e2"]
        assert sorted(p.name for p in tmp_path.iterdir()) == names
        assert load_latest(tmp_path).step == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("frozen_before", ["folder", "pointer"])
@pytest.mark.parametrize("replacement", ["writer", "claim and write"])
def test_a_writer_frozen_right_after_its_last_check_cannot_overwrite_its_replacement(
    tmp_path: Path, frozen_before: str, replacement: str
) -> None:
    """The residual window: a writer that read the claim (still its own) and froze before the
    rename that publishes (of its step folder, or of its pointer) resumes after its replacement
    claimed the folder, restored, and wrote the same step. A replacement's writer clears the
    unfinished files it finds, so the frozen write fails ("writer"); without that clearing
    ("claim and write") the frozen write's renames land, but under names of its own epoch only.
    Either way the replacement's checkpoint of that step is intact and the one read, and the
    fenced writer's prune removed nothing the replacement uses."""
    model, optimizer = _fresh(0)
    first = CheckpointWriter(tmp_path, keep=1, epoch=1)
    first.save(to_host(model, optimizer, step=1))
    first.wait()
    asks, frozen, release = 0, threading.Event(), threading.Event()
    publish_ask = 1 if frozen_before == "folder" else 2

    def checked_then_frozen() -> bool:
        nonlocal asks
        asks += 1
        if asks == publish_ask:
            frozen.set()  # the claim was read (epoch 1 owns the folder), then a freeze
            assert release.wait(10)
        return True

    outcome: list[object] = []

    def write_as_epoch_1() -> None:
        snapshot = to_host(model, optimizer, step=2, extra={"by": 1})
        try:
            outcome.append(
                write_snapshot(
                    tmp_path, snapshot, keep=1, epoch=1, still_wanted=checked_then_frozen
                )
            )
        except FileNotFoundError as exc:  # the replacement cleared its unfinished files
            outcome.append(exc)

    zombie = threading.Thread(target=write_as_epoch_1)
    zombie.start()
    assert frozen.wait(10)

    trained, _ = _fresh(7)
    ours = to_host(trained, optimizer, step=2, extra={"by": 2})
    if replacement == "writer":
        writer = CheckpointWriter(tmp_path, keep=1, epoch=2)
        assert load_latest(tmp_path).step == 1  # type: ignore[union-attr]
        writer.save(ours)
        writer.close(timeout=10)
    else:
        claim(tmp_path, 2)
        assert load_latest(tmp_path).step == 1  # type: ignore[union-attr]
        write_snapshot(tmp_path, ours, keep=1, epoch=2)
    release.set()
    zombie.join(10)
    latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 2 and latest.extra == {"by": 2}
    for name, tensor in trained.state_dict().items():
        assert torch.equal(latest.model_state[name], tensor)
    assert (tmp_path / "latest.e2").read_text().strip() == "step-2.e2"
    if replacement == "writer":
        assert isinstance(outcome[0], FileNotFoundError)
    else:
        assert outcome == [tmp_path / "step-2.e1"]  # published, under its own names only
        assert (tmp_path / "latest.e1").read_text().strip() == "step-2.e1"
    first.close(timeout=10)
