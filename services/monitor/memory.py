"""Giving memory back to the system once the monitor has forgotten many members.

CPython frees the objects of a forgotten view, but its small-object allocator returns an arena
(1 MiB) only once every object in it is freed, and a few long-lived objects made while many
members beat keep most arenas of that moment: after a few thousand members come and go, the
monitor's RSS would stay near its peak. The monitor therefore runs on jemalloc where the host
has it (decision 0020): every allocation goes to jemalloc, which returns each freed page. On
glibc's allocator, malloc_trim returns what is free at the top of the heap and in its arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import linecache
import os
from collections.abc import Mapping
from pathlib import Path

JEMALLOC_LIBS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
"""Where Debian (package libjemalloc2), Ubuntu and RPM distributions put the library."""

JEMALLOC_CONF = "narenas:1,tcache:false,dirty_decay_ms:0,muzzy_decay_ms:0"
"""One arena and no per-thread caches (the monitor's work is one event loop; gRPC's threads
allocate little), and freed pages returned at once rather than after a delay."""


def find_jemalloc() -> str | None:
    return next((lib for lib in JEMALLOC_LIBS if Path(lib).exists()), None)


def jemalloc_env(
    environ: Mapping[str, str], allocator: str, jemalloc: str | None
) -> dict[str, str] | None:
    """The environment to start the monitor again in, on jemalloc; None to go on as it is (the
    `python` allocator asked for, no jemalloc on this host, or preloaded already)."""
    preload = environ.get("LD_PRELOAD", "")
    if allocator != "jemalloc" or jemalloc is None or "jemalloc" in preload:
        return None
    return {
        **environ,
        "LD_PRELOAD": f"{jemalloc} {preload}".strip(),
        "PYTHONMALLOC": "malloc",  # objects too, not only what CPython's arenas hold
        "MALLOC_CONF": environ.get("MALLOC_CONF") or JEMALLOC_CONF,
    }


def start_on_jemalloc(allocator: str, argv: list[str]) -> None:
    """Replace this process with the same command on jemalloc (`jemalloc_env`); returns only
    if it stays as it is. Done before anything is imported or started."""
    env = jemalloc_env(os.environ, allocator, find_jemalloc())
    if env is not None:
        os.execve(argv[0], argv, env)


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
