"""Per-step asynchronous checkpoints of the trainer: policy, optimizer, step, RNG, extra.

A checkpoint is taken in two parts so the training step barely waits:

1. :func:`to_host` (``snapshot.py``) copies model and optimizer state (and the RNG state) into
   CPU memory. This copy is the only part that blocks the step.
2. :class:`CheckpointWriter` (``writer.py``) writes the snapshot from a background thread to
   ``dir/step-<N>.e<E>/`` (E: the trainer's epoch): files go into a temporary directory that
   is renamed into place, and the pointer file (``latest.e<E>``) is replaced last, so a crash
   at any moment leaves the pointer naming a complete checkpoint. Only the newest ``keep``
   checkpoints stay on disk (and any a pointer names).

A write error is not swallowed: it is raised by the next :meth:`CheckpointWriter.save` or by
:meth:`CheckpointWriter.wait`. ``extra`` carries JSON data that must survive a restart with
the weights it belongs to (the trainer keeps its committed-trajectory watermark there).

Layout of a checkpoint folder: ``model.safetensors``, ``optimizer.pt``, ``rng.pt`` and
``meta.json`` (``{"format": 1, "step": N, "extra": {...}, "sharded": false}``). FSDP2 ranks
(``trainer.strategy: fsdp``) write a sharded one instead: every rank its shards through
torch.distributed.checkpoint (``__<rank>_0.distcp`` and DCP's ``.metadata``) into the
temporary folder, asynchronously (:class:`ShardedSnapshot`); the writer adds ``rng.pt`` and
``meta.json`` (``"sharded": true``) and publishes it the same way. It restores at any world
size, and into a single whole model. Which trainer epoch owns the
directory, and the names that keep a fenced writer from overwriting its replacement's, are
``folder.py``'s; reading a checkpoint back and restoring it, ``reader.py``'s.
"""

from services.trainer.checkpoint.folder import (
    CheckpointError,
    Superseded,
    claim,
    new_tmp,
    newer_owner,
    owner_epoch,
    pointer_name,
    replace_text,
    step_name,
)
from services.trainer.checkpoint.reader import Checkpoint, load_checkpoint, load_latest, restore
from services.trainer.checkpoint.snapshot import (
    RngState,
    ShardedSnapshot,
    Snapshot,
    capture_rng,
    json_copy,
    restore_rng,
    to_host,
)
from services.trainer.checkpoint.writer import CheckpointWriter, write_snapshot

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "RngState",
    "ShardedSnapshot",
    "Snapshot",
    "Superseded",
    "capture_rng",
    "claim",
    "json_copy",
    "load_checkpoint",
    "load_latest",
    "new_tmp",
    "newer_owner",
    "owner_epoch",
    "pointer_name",
    "replace_text",
    "restore",
    "restore_rng",
    "step_name",
    "to_host",
    "write_snapshot",
]
