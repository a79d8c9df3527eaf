"""Giving memory back to the system once the monitor has forgotten many members.

CPython frees the objects of a forgotten view, but the allocator keeps the freed pages unless
they are handed back; after a few thousand members come and go, the monitor's RSS would stay at
its peak. glibc's malloc_trim returns what is free at the top of the heap and in its arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import linecache


@functools.cache
def _trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    return trim


def release_freed_memory() -> None:
    # Source lines read to format tracebacks (gRPC formats one for every call that fails)
    # stay cached for ever, and pin the small-object arenas of the moment they were read.
    linecache.clearcache()
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
