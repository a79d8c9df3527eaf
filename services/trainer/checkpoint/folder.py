"""A job's checkpoint folder: what its entries are named, which trainer epoch owns it, and
how a file in it is replaced durably.

``dir/owner`` names the trainer epoch that owns the directory (``{"epoch": E}``). A trainer
claims it (:func:`claim`, by its writer) before it reads a pointer; a writer of an older
epoch then publishes nothing more (:class:`Superseded`). That covers a fenced trainer that
never heard of its fence: one frozen mid-write (SIGSTOP, a stalled disk) that resumes after
its replacement restored (docs/decisions/0011-checkpoint-folder-claims.md).

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
import re
import uuid
from pathlib import Path

FORMAT_VERSION = 1
LATEST = "latest"
OWNER = "owner"
STEP_DIR = re.compile(r"^step-(\d+)(?:\.e(\d+))?$")
POINTER = re.compile(r"^latest(?:\.e(\d+))?$")
NO_EPOCH = -1
"""The rank of a writer with no epoch: below every trainer epoch."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or what is on disk is not a valid checkpoint."""


class Superseded(CheckpointError):
    """The directory was claimed by a newer trainer epoch: this trainer was fenced."""

    def __init__(self, directory: Path, epoch: int, owner: int) -> None:
        super().__init__(f"{directory} is owned by trainer epoch {owner}, newer than {epoch}")
        self.owner = owner


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def replace_text(path: Path, text: str) -> None:
    """Write `path` as a new file renamed over the old one (durably): a reader sees the old
    contents or the new, and a writer that opened the old file writes into that one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    fsync_file(tmp)
    tmp.replace(path)
    fsync_dir(path.parent)


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
    found = pointers(directory)
    newest = max(found, default=NO_EPOCH - 1)
    if newest < epoch:
        named = found[newest][1] if found else ""
        replace_text(directory / pointer_name(epoch), named + "\n")


def step_name(step: int, epoch: int | None) -> str:
    """The folder of the checkpoint of ``step`` written by trainer ``epoch``."""
    return f"step-{step}" if epoch is None else f"step-{step}.e{epoch}"


def new_tmp(directory: Path, step: int, epoch: int | None) -> Path:
    """A fresh folder to write step `step`'s checkpoint into before it is renamed into place
    (a writer that dies leaves it; the next writer of the directory clears it)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{step_name(step, epoch)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def pointer_name(epoch: int | None) -> str:
    """The pointer file of trainer ``epoch``'s writer."""
    return LATEST if epoch is None else f"{LATEST}.e{epoch}"


def pointers(directory: Path) -> dict[int, tuple[Path, str]]:
    """Every pointer by its epoch (NO_EPOCH for ``latest``): its file and the folder it names
    ('' for none)."""
    found: dict[int, tuple[Path, str]] = {}
    for entry in directory.iterdir() if directory.is_dir() else []:
        m = POINTER.match(entry.name)
        if m is None:
            continue
        try:
            named = entry.read_text().strip()
        except FileNotFoundError:
            continue  # pruned as we listed it
        found[int(m.group(1)) if m.group(1) else NO_EPOCH] = (entry, named)
    return found


def newest_pointer(directory: Path) -> tuple[Path, str] | None:
    """The pointer of the newest epoch and the folder it names ('' for none yet), or None
    when there is no pointer at all."""
    found = pointers(directory)
    return found[max(found)] if found else None


def step_dirs(directory: Path) -> list[tuple[int, int, Path]]:
    """Every checkpoint folder as (epoch, step, path), oldest first."""
    found = []
    for entry in directory.iterdir() if directory.is_dir() else []:
        m = STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            epoch = int(m.group(2)) if m.group(2) else NO_EPOCH
            found.append((epoch, int(m.group(1)), entry))
    return sorted(found)
