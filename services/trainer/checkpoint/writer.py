"""Writing checkpoints: one snapshot to its folder atomically (:func:`write_snapshot`), and
the background thread that writes the trainer's snapshots while it trains
(:class:`CheckpointWriter`). A writer publishes only while its epoch owns the folder
(``folder.py``)."""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.trainer.checkpoint import folder
from services.trainer.checkpoint.folder import CheckpointError, Superseded
from services.trainer.checkpoint.snapshot import ShardedSnapshot, Snapshot, rng_to_plain


def write_snapshot(
    directory: str | Path,
    snapshot: Snapshot | ShardedSnapshot,
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
    name = folder.step_name(snapshot.step, epoch)
    sharded = isinstance(snapshot, ShardedSnapshot)
    if isinstance(snapshot, ShardedSnapshot):
        tmp = snapshot.folder
    else:
        tmp = folder.new_tmp(directory, snapshot.step, epoch)
    try:
        if isinstance(snapshot, ShardedSnapshot):
            # Every rank's shards (`__<rank>_0.distcp`) and DCP's `.metadata`.
            snapshot.written.result()
        else:
            save_file(snapshot.model_state, str(tmp / "model.safetensors"))
            torch.save(snapshot.optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_to_plain(snapshot.rng), tmp / "rng.pt")
        meta = {
            "format": folder.FORMAT_VERSION,
            "step": snapshot.step,
            "extra": snapshot.extra,
            "sharded": sharded,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        for f in tmp.iterdir():
            folder.fsync_file(f)
        folder.fsync_dir(tmp)
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
    folder.fsync_dir(directory)
    pointer = folder.pointer_name(epoch)
    pointer_tmp = directory / f".{pointer}.tmp-{uuid.uuid4().hex[:8]}"
    published = False
    try:
        pointer_tmp.write_text(name + "\n")
        folder.fsync_file(pointer_tmp)
        if still_wanted():  # asked again right before the rename that publishes
            pointer_tmp.replace(directory / pointer)
            published = True
    finally:
        if not published:  # not wanted, or failed: no folder that no pointer names
            pointer_tmp.unlink(missing_ok=True)
            if name not in {named for _, named in folder.pointers(directory).values()}:
                shutil.rmtree(final, ignore_errors=True)
    if not published:
        return None
    folder.fsync_dir(directory)
    _prune(directory, keep=keep, epoch=epoch, current=final)
    return final


def _prune(directory: Path, *, keep: int, epoch: int | None, current: Path) -> None:
    """Keep the ``keep`` newest folders by (epoch, step), and every folder a pointer names.
    A writer whose pointer is the newest removes the older epochs' pointers (nothing reads
    them again); a writer of an older epoch (fenced after its last check) removes nothing a
    newer epoch wrote, and nothing the newer epoch's pointer names."""
    own = folder.NO_EPOCH if epoch is None else epoch
    pointers = folder.pointers(directory)
    if max(pointers, default=own) == own:
        for older in [e for e in pointers if e < own]:
            pointers.pop(older)[0].unlink(missing_ok=True)
    named = {name for _, name in pointers.values()}
    folders = folder.step_dirs(directory)
    for folder_epoch, _, path in folders[: max(0, len(folders) - keep)]:
        if folder_epoch <= own and path != current and path.name not in named:
            shutil.rmtree(path, ignore_errors=True)


def _drop(snapshot: Snapshot | ShardedSnapshot) -> None:
    """A snapshot that will not be written: a sharded one's folder goes once the ranks are
    done writing into it."""
    if isinstance(snapshot, ShardedSnapshot):
        snapshot.written.add_done_callback(
            lambda _: shutil.rmtree(snapshot.folder, ignore_errors=True)
        )


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
        """``epoch``: the trainer's; the directory is claimed for it (:func:`folder.claim`)
        first, and the writer publishes only while no newer epoch has claimed it. None: no
        claim."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.epoch = epoch
        if epoch is not None:
            folder.claim(self.directory, epoch)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-step-*"):
            # Left by a writer that died mid-write; never named by a pointer.
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.directory.glob(f".{folder.LATEST}*.tmp*"):
            stale.unlink(missing_ok=True)
        self.keep = keep
        self.on_written = on_written
        self.durable_step: int | None = None
        """Step of the newest checkpoint known to be complete on disk."""
        self._pending: Snapshot | ShardedSnapshot | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._abandoned = False
        self.superseded_by: int | None = None
        """The newer epoch that claimed the directory, once this writer saw it."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def save(self, snapshot: Snapshot | ShardedSnapshot) -> None:
        """Queue ``snapshot`` for writing and return at once; raises an earlier write's error,
        and Superseded once a newer epoch has claimed the directory."""
        with self._cond:
            self._raise_superseded()
            self._raise_error()
            if self._closed:
                raise CheckpointError("checkpoint writer is closed")
            if self._abandoned:
                _drop(snapshot)
                return
            if self._pending is not None:
                _drop(self._pending)
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
        longer raised (the newer trainer clearing the unfinished write it found is one)."""
        with self._cond:
            self._abandoned = True
            if self._pending is not None:
                _drop(self._pending)
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
            owner = folder.newer_owner(self.directory, self.epoch)
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
        (``folder.py``)."""
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
