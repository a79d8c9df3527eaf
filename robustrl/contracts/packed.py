"""Records the leader rewrites whole on nearly every request, stored zlib-compressed.

etcd keeps every revision of a key until its history is compacted, so what a job costs etcd is
the bytes written, not the bytes kept. The work ledger is rewritten on every lease and every
completion, and its JSON repeats the same keys, group-id prefixes and member names in every
entry, so zlib's fastest level shrinks it many times over (decision 0007 has the figures).

`dump` writes compressed JSON; `load` reads that and plain JSON alike (a value starts with `{`
only if it is plain JSON; zlib's stream never does), so values written before, or put by hand
with etcdctl, still load. Decompression stops at `MAX_JSON_BYTES`: a corrupt or hostile value
cannot make a reader allocate without bound.
"""

from __future__ import annotations

import zlib
from typing import TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

LEVEL = 1
"""zlib's fastest level: ~12x on a ledger already, at a few times the speed of level 6."""

MAX_JSON_BYTES = 64 << 20
"""The most a value may decompress to (etcd's own default limit on a request is 1.5 MiB)."""


def dump(record: BaseModel) -> bytes:
    """The record's JSON, zlib-compressed."""
    return zlib.compress(record.model_dump_json().encode(), LEVEL)


def load(model: type[M], raw: bytes) -> M:
    """A record stored by `dump`, or as plain JSON. Raises ValueError (pydantic's
    ValidationError is one) for anything else."""
    return model.model_validate_json(json_of(raw, model.__name__))


def json_of(raw: bytes, what: str = "packed") -> bytes:
    """The JSON text of a value stored by `dump` or as plain JSON (ValueError naming `what`
    if it is neither). Bytes after a compressed value are ignored: etcdctl prints a newline."""
    if raw.lstrip()[:1] == b"{":
        return raw
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(raw, MAX_JSON_BYTES)
    except zlib.error as exc:
        raise ValueError(f"not a {what} record: neither JSON nor zlib ({exc})") from exc
    if inflater.unconsumed_tail:
        raise ValueError(f"{what} record decompresses to over {MAX_JSON_BYTES} bytes")
    if not inflater.eof:
        raise ValueError(f"{what} record is truncated ({len(raw)} bytes)")
    return text
