"""Per-step asynchronous checkpoints of the trainer: policy, optimizer, step, RNG, extra.

A checkpoint is taken in two parts so the training step barely waits:

1. :func:`to_host` copies model and optimizer state (and the RNG state) into CPU memory.
   This copy is the only part that blocks the step.
2. :class:`CheckpointWriter` writes the snapshot from a background thread to
   ``dir/step-<N>.e<E>/`` (E: the trainer's epoch): files go into a temporary directory that
   is renamed into place, and the pointer file (``latest.e<E>``) is replaced last, so a crash
   at any moment leaves the pointer naming a complete checkpoint. Only the newest ``keep``
   checkpoints stay on disk (and any a pointer names).

A write error is not swallowed: it is raised by the next :meth:`CheckpointWriter.save` or by
:meth:`CheckpointWriter.wait`. ``extra`` carries JSON data that must survive a restart with
the weights it belongs to (the trainer keeps its committed-trajectory watermark there).

Layout of a checkpoint folder: ``model.safetensors``, ``optimizer.pt``, ``rng.pt`` and
``meta.json`` (``{"format": 1, "step": N, "extra": {...}}``).

``dir/owner`` names the trainer epoch that owns the directory (``{"epoch": E}``). A trainer
claims it (:func:`claim`, by its writer) before it reads a pointer; a writer of an older
epoch then publishes nothing more (:class:`Superseded`). That covers a fenced trainer that
never heard of its fence: one frozen mid-write (SIGSTOP, a stalled disk) that resumes after
its replacement restored used to publish that write and point the pointer at it.

Names carry the writer's epoch, so a writer that passed its last check of the claim and froze
right there (the microseconds before a rename) cannot overwrite what a newer epoch wrote or
restored from: folders are ``step-<N>.e<E>`` and each epoch has a pointer of its own,
``latest.e<E>``. The pointer of the newest epoch is the one read. A claim first writes the
claimer's pointer naming what the newest pointer named (empty when nothing was written yet), so
from the claim on, a late write of an older epoch's pointer is never read. A writer with no
epoch (tests, tools) writes ``step-<N>`` and ``latest``, which rank below every epoch.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
LATEST = "latest"
OWNER = "owner"
_STEP_DIR = re.compile(r"^step-(\d+)(?:\.e(\d+))?$")
_POINTER = re.compile(r"^latest(?:\.e(\d+))?$")
_NO_EPOCH = -1  # the rank of a writer with no epoch: below every trainer epoch


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or what is on disk is not a valid checkpoint."""


class Superseded(CheckpointError):
    """The directory was claimed by a newer trainer epoch: this trainer was fenced."""

    def __init__(self, directory: Path, epoch: int, owner: int) -> None:
        super().__init__(f"{directory} is owned by trainer epoch {owner}, newer than {epoch}")
        self.owner = owner


# --- RNG state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RngState:
    """Every random generator a training step draws from."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]


def capture_rng() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return RngState(
        torch_cpu=torch.random.get_rng_state().clone(),
        torch_cuda=[s.clone() for s in cuda],
        python=random.getstate(),
        numpy=tuple(np.random.get_state()),
    )


def restore_rng(state: RngState) -> None:
    torch.random.set_rng_state(state.torch_cpu)
    if state.torch_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state.torch_cuda)
    random.setstate(state.python)
    np.random.set_state(state.numpy)


def _rng_to_plain(state: RngState) -> dict[str, Any]:
    # Plain containers only, so the file loads with torch.load(weights_only=True).
    version, internal, gauss = state.python
    name, keys, pos, has_gauss, cached = state.numpy
    return {
        "torch_cpu": state.torch_cpu,
        "torch_cuda": list(state.torch_cuda),
        "python": [version, list(internal), gauss],
        "numpy": [
            str(name),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
    }


def _rng_from_plain(d: dict[str, Any]) -> RngState:
    version, internal, gauss = d["python"]
    name, keys, pos, has_gauss, cached = d["numpy"]
    return RngState(
        torch_cpu=d["torch_cpu"],
        torch_cuda=list(d["torch_cuda"]),
        python=(version, tuple(internal), gauss),
        numpy=(name, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
    )


# --- snapshot in host memory --------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Training state copied to CPU memory: safe to write while training goes on."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: RngState
    extra: dict[str, Any]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def to_host(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rng_state: RngState | None = None,
    extra: dict[str, Any] | None = None,
) -> Snapshot:
    """Copy the state of a step into CPU memory (the blocking part of a checkpoint).

    ``rng_state`` defaults to the generators' state now. ``extra`` must be JSON-serialisable;
    it is copied, so later changes by the caller do not leak into the snapshot.
    """
    try:
        extra_copy = json.loads(json.dumps(extra or {}, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from e
    if not isinstance(extra_copy, dict):
        raise ValueError("checkpoint extra must be a JSON object")
    return Snapshot(
        step=step,
        model_state={
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()
        },
        optimizer_state=_to_cpu(optimizer.state_dict()),
        rng=rng_state if rng_state is not None else capture_rng(),
        extra=extra_copy,
    )


# --- writing ------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def owner_epoch(directory: str | Path) -> int | None:
    """The trainer epoch that claimed ``directory`` (None: no claim yet)."""
    path = Path(directory) / OWNER
    try:
        return int(json.loads(path.read_text())["epoch"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not an owner record: {e!r}") from e


def newer_owner(directory: str | Path, epoch: int) -> int | None:
    """The epoch that claimed ``directory`` if it is newer than ``epoch``, else None."""
    owner = owner_epoch(directory)
    return owner if owner is not None and owner > epoch else None


def claim(directory: str | Path, epoch: int) -> None:
    """Make trainer ``epoch`` the owner of ``directory``; Superseded if a newer epoch owns it.
    Epochs only grow (the leader numbers each trainer it binds to a job), so an older claim
    never comes after a newer one from a live trainer.

    The claimer's pointer (``latest.e<epoch>``) is then made to name what the newest pointer
    names, before anything is restored: a pointer an older epoch's writer renames into place
    later ranks below it and is never read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (owner := newer_owner(directory, epoch)) is not None:
        raise Superseded(directory, epoch, owner)
    replace_text(directory / OWNER, json.dumps({"epoch": epoch}) + "\n")
    pointers = _pointers(directory)
    newest = max(pointers, default=_NO_EPOCH - 1)
    if newest < epoch:
        named = pointers[newest][1] if pointers else ""
        replace_text(directory / pointer_name(epoch), named + "\n")


def step_name(step: int, epoch: int | None) -> str:
    """The folder of the checkpoint of ``step`` written by trainer ``epoch``."""
    return f"step-{step}" if epoch is None else f"step-{step}.e{epoch}"


def pointer_name(epoch: int | None) -> str:
    """The pointer file of trainer ``epoch``'s writer."""
    return LATEST if epoch is None else f"{LATEST}.e{epoch}"


def _pointers(directory: Path) -> dict[int, tuple[Path, str]]:
    """Every pointer by its epoch (_NO_EPOCH for ``latest``): its file and the folder it names
    ('' for none)."""
    found: dict[int, tuple[Path, str]] = {}
    for entry in directory.iterdir() if directory.is_dir() else []:
        m = _POINTER.match(entry.name)
        if m is None:
            continue
        try:
            named = entry.read_text().strip()
        except FileNotFoundError:
            continue  # pruned as we listed it
        found[int(m.group(1)) if m.group(1) else _NO_EPOCH] = (entry, named)
    return found


def replace_text(path: Path, text: str) -> None:
    """Write `path` as a new file renamed over the old one (durably): a reader sees the old
    contents or the new, and a writer that opened the old file writes into that one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    _fsync_file(tmp)
    tmp.replace(path)
    _fsync_dir(path.parent)


def _step_dirs(directory: Path) -> list[tuple[int, int, Path]]:
    """Every checkpoint folder as (epoch, step, path), oldest first."""
    found = []
    for entry in directory.iterdir() if directory.is_dir() else []:
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            epoch = int(m.group(2)) if m.group(2) else _NO_EPOCH
            found.append((epoch, int(m.group(1)), entry))
    return sorted(found)


def write_snapshot(
    directory: str | Path,
    snapshot: Snapshot,
    *,
    keep: int,
    epoch: int | None = None,
    still_wanted: Callable[[], bool] = lambda: True,
) -> Path | None:
    """Write ``snapshot`` as ``directory/step-<N>.e<epoch>`` atomically, point ``epoch``'s
    pointer at it, prune.

    Synchronous; :class:`CheckpointWriter` calls it from its thread. ``still_wanted`` is asked
    once the files are written, before anything is published, and again before the pointer is
    replaced: if it says no (the trainer was fenced meanwhile), what is not published yet is
    removed and None is returned. A writer fenced right after its last ask still writes only
    its own epoch's names, which its replacement's pointer outranks.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = step_name(snapshot.step, epoch)
    tmp = directory / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(snapshot.model_state, str(tmp / "model.safetensors"))
        torch.save(snapshot.optimizer_state, tmp / "optimizer.pt")
        torch.save(_rng_to_plain(snapshot.rng), tmp / "rng.pt")
        meta = {"format": FORMAT_VERSION, "step": snapshot.step, "extra": snapshot.extra}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if not still_wanted():
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        final = directory / name
        if final.exists():
            # The same step written again by the same epoch: the new copy wins.
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(directory)
    pointer = pointer_name(epoch)
    pointer_tmp = directory / f".{pointer}.tmp-{uuid.uuid4().hex[:8]}"
    published = False
    try:
        pointer_tmp.write_text(name + "\n")
        _fsync_file(pointer_tmp)
        if still_wanted():  # asked again right before the rename that publishes
            pointer_tmp.replace(directory / pointer)
            published = True
    finally:
        if not published:  # not wanted, or failed: no folder that no pointer names
            pointer_tmp.unlink(missing_ok=True)
            if name not in {named for _, named in _pointers(directory).values()}:
                shutil.rmtree(final, ignore_errors=True)
    if not published:
        return None
    _fsync_dir(directory)
    _prune(directory, keep=keep, epoch=epoch, current=final)
    return final


def _newest_pointer(directory: Path) -> tuple[Path, str] | None:
    """The pointer of the newest epoch and the folder it names ('' for none yet), or None
    when there is no pointer at all."""
    pointers = _pointers(directory)
    return pointers[max(pointers)] if pointers else None


def _prune(directory: Path, *, keep: int, epoch: int | None, current: Path) -> None:
    """Keep the ``keep`` newest folders by (epoch, step), and every folder a pointer names.
    A writer whose pointer is the newest removes the older epochs' pointers (nothing reads
    them again); a writer of an older epoch (fenced after its last check) removes nothing a
    newer epoch wrote, and nothing the newer epoch's pointer names."""
    own = _NO_EPOCH if epoch is None else epoch
    pointers = _pointers(directory)
    if max(pointers, default=own) == own:
        for older in [e for e in pointers if e < own]:
            pointers.pop(older)[0].unlink(missing_ok=True)
    named = {name for _, name in pointers.values()}
    folders = _step_dirs(directory)
    for folder_epoch, _, path in folders[: max(0, len(folders) - keep)]:
        if folder_epoch <= own and path != current and path.name not in named:
            shutil.rmtree(path, ignore_errors=True)


class CheckpointWriter:
    """Writes snapshots from one background thread.

    If snapshots arrive faster than the disk takes them, a snapshot still waiting is
    replaced by the newer one: the newest state is what a restart wants, and ``extra``
    (the commit watermark) of the newer snapshot covers the older one's. ``on_written`` is
    called from the writer thread with (step, extra) once a checkpoint is durable.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        on_written: Callable[[int, dict[str, Any]], None] | None = None,
        epoch: int | None = None,
    ) -> None:
        """``epoch``: the trainer's; the directory is claimed for it (:func:`claim`) first, and
        the writer publishes only while no newer epoch has claimed it. None: no claim."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.epoch = epoch
        if epoch is not None:
            claim(self.directory, epoch)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-step-*"):
            # Left by a writer that died mid-write; never named by a pointer.
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.directory.glob(f".{LATEST}*.tmp*"):
            stale.unlink(missing_ok=True)
        self.keep = keep
        self.on_written = on_written
        self.durable_step: int | None = None
        """Step of the newest checkpoint known to be complete on disk."""
        self._pending: Snapshot | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._abandoned = False
        self.superseded_by: int | None = None
        """The newer epoch that claimed the directory, once this writer saw it."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def save(self, snapshot: Snapshot) -> None:
        """Queue ``snapshot`` for writing and return at once; raises an earlier write's error,
        and Superseded once a newer epoch has claimed the directory."""
        with self._cond:
            self._raise_superseded()
            self._raise_error()
            if self._closed:
                raise CheckpointError("checkpoint writer is closed")
            if self._abandoned:
                return
            self._pending = snapshot
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything queued is written; raises a write error."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: (self._pending is None and not self._busy) or self._error is not None,
                timeout=timeout,
            )
            self._raise_error()
            if not done:
                raise TimeoutError(f"checkpoint write still running after {timeout}s")

    def abandon(self) -> None:
        """The trainer was fenced (a newer one owns this directory): nothing more of this
        writer reaches the disk. The queued snapshot is dropped, a write in progress is not
        published (its files are removed, its pointer is left alone), and write errors are no
        longer raised (the newer trainer clearing the unfinished write it found is one).
        Before, a fenced trainer finished its queued write as it stopped and could point
        its pointer at it after its replacement had restored and gone on."""
        with self._cond:
            self._abandoned = True
            self._pending = None
            self._error = None
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Finish queued writes and stop the thread; raises a write error. Idempotent."""
        try:
            self.wait(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout)

    def _raise_error(self) -> None:
        if self._error is not None and not self._abandoned:
            error, self._error = self._error, None
            raise CheckpointError(
                f"writing a checkpoint to {self.directory} failed: {error!r}"
            ) from error

    def ensure_owner(self) -> None:
        """Superseded if a newer epoch has claimed the directory (the trainer asks before it
        appends to the run's logs, which its replacement truncated at restore)."""
        self._look_for_newer_owner()
        self._raise_superseded()

    def _raise_superseded(self) -> None:
        if self.superseded_by is not None and self.epoch is not None:
            raise Superseded(self.directory, self.epoch, self.superseded_by)

    def _look_for_newer_owner(self) -> None:
        """Read the claim; a newer one is remembered (`superseded_by`) and abandons the
        writer. Once seen, it is not read again."""
        if self.epoch is None or self.superseded_by is not None:
            return
        try:
            owner = newer_owner(self.directory, self.epoch)
        except CheckpointError:
            return  # unreadable: the next claim says so
        if owner is not None:
            with self._cond:
                self.superseded_by = owner
                self._abandoned = True

    def _wanted(self) -> bool:
        """Publish? Not once abandoned, nor once a newer epoch claimed the directory (this
        trainer was fenced, and may not know it yet: it was frozen, say). The claim is read
        right before each publishing rename. A freeze in the microseconds between the read and
        the rename is covered by the names: what this writer then renames is its own epoch's
        (the module docstring)."""
        with self._cond:
            if self._abandoned:
                return False
        self._look_for_newer_owner()
        return self.superseded_by is None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snapshot, self._pending = self._pending, None
                self._busy = True
            try:
                written = write_snapshot(
                    self.directory,
                    snapshot,
                    keep=self.keep,
                    epoch=self.epoch,
                    still_wanted=self._wanted,
                )
                if written is not None and self.on_written is not None:
                    self.on_written(snapshot.step, snapshot.extra)
            except BaseException as e:  # handed to the training thread
                wanted = self._wanted()  # a newer owner clears the unfinished writes it finds
                with self._cond:
                    self._error = e if wanted else None
            else:
                with self._cond:
                    if written is not None:
                        self.durable_step = snapshot.step
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: RngState
    extra: dict[str, Any]
    path: Path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read one ``step-<N>`` directory; CheckpointError if it is incomplete or unreadable."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
        return Checkpoint(
            step=int(meta["step"]),
            model_state=load_file(str(path / "model.safetensors")),
            optimizer_state=torch.load(path / "optimizer.pt", weights_only=True),
            rng=_rng_from_plain(torch.load(path / "rng.pt", weights_only=True)),
            extra=dict(meta.get("extra", {})),
            path=path,
        )
    except CheckpointError:
        raise
    except Exception as e:  # safetensors, pickle and json all have their own error types
        raise CheckpointError(f"{path}: not a readable checkpoint: {e!r}") from e


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The checkpoint the newest epoch's pointer names, or None when nothing was written (or
    the newest epoch claimed the directory before anything was)."""
    directory = Path(directory)
    found = _newest_pointer(directory)
    if found is None or not found[1]:
        return None
    pointer, name = found
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: does not name a checkpoint: {name!r}")
    target = directory / name
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is missing from {directory}")
    return load_checkpoint(target)


def restore(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
) -> int:
    """Load a checkpoint into ``model`` (strictly), ``optimizer`` and the RNGs; returns its step."""
    model.load_state_dict(checkpoint.model_state, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint.optimizer_state)
    if rng:
        restore_rng(checkpoint.rng)
    return checkpoint.step
