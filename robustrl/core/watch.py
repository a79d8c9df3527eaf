"""A prefix watch that survives what a long-lived watch meets: compaction and lost streams.

It resumes from the revision after the last event it delivered; if that revision was
compacted away, or the watch broke at the same revision `RESYNC_AFTER_FAILURES` times in a row
(history etcd cannot deliver to this client, e.g. a catch-up larger than its largest message),
it re-lists the prefix and hands the caller a `Resync` with the full current state, then
watches on from there. Callers that need the initial state call `list_prefix`
first and start the watch at the revision the list returned, plus one.

Every watch here is created through `_open_watch`, which never lets a cancellation cut a
creation short (see there why that matters).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import aetcd

from robustrl.core.aio import raise_if_cancelled
from robustrl.core.logs import get_logger

log = get_logger(__name__)

RESYNC_AFTER_FAILURES = 3

RESET_WAIT_S = 5.0
"""How long a watch whose creation timed out waits for the client's watch stream to end."""


@dataclass(frozen=True)
class Entry:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Put:
    entry: Entry


@dataclass(frozen=True)
class Delete:
    key: bytes
    revision: int


@dataclass(frozen=True)
class Resync:
    """The watched history was compacted (or could not be delivered): this is the whole prefix
    as of `revision`."""

    entries: list[Entry]
    revision: int


WatchEvent = Put | Delete | Resync


def _entry(kv: aetcd.rtypes.KeyValue) -> Entry:
    return Entry(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)


async def list_prefix(client: aetcd.Client, prefix: bytes) -> tuple[list[Entry], int]:
    """All entries under prefix and the revision they were read at."""
    result = await client.get_prefix(prefix)
    return [_entry(kv) for kv in result], result.header.revision


_closing: set[asyncio.Future[Any]] = set()  # work left to finish on its own, kept referenced


def _in_background(work: Awaitable[Any]) -> asyncio.Future[Any]:
    """work as a task that no caller's cancellation reaches, referenced until it ends."""
    task = asyncio.ensure_future(work)
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    return task


async def _wait_at_most(work: Awaitable[Any], wait_s: float) -> None:
    """Run work in the background (`_in_background`) and wait for it for at most wait_s; its
    errors are ignored. A cancel of the caller ends the wait and reaches the caller, not work:
    aetcd's calls here can hang on a dead stream, or swallow a cancel they are given."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(_in_background(work)), wait_s)


async def _open_watch(client: aetcd.Client, prefix: bytes, start_revision: int) -> aetcd.Watch:
    """client.watch_prefix, safe to cancel.

    aetcd pairs etcd's "created" answer with whichever watch creation is pending when the
    answer arrives. A creation cancelled before its answer leaves that answer to the next
    creation on the client, which then carries the cancelled watch's id and events, and its own
    never come (decision 0005). So a creation always
    runs to its end, and the watch of a caller cancelled meanwhile is cancelled once it exists.
    """
    creating = asyncio.ensure_future(client.watch_prefix(prefix, start_revision=start_revision))
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError:
        creating.add_done_callback(_cancel_abandoned)
        raise
    except aetcd.exceptions.WatchTimeoutError:
        await _reset_watch_stream(client, prefix)
        raise


async def _reset_watch_stream(client: aetcd.Client, prefix: bytes) -> None:
    """After a creation timed out, end the client's watch stream, and every watch on it.

    etcd answers a creation late when it stalls; that late answer would go to the next
    creation on the same stream, which would then see the timed-out watch's keys instead of its
    own, silently (reproduced in test_etcd_layer with a stopped etcd). On a new stream no late
    answer can arrive. The ended watches finish their iteration; `watch_prefix` opens them
    again from the revision after their last event, so none of their events is lost.
    aetcd has no public call for this; `_watcher` is its per-client watch stream.
    """
    watcher = getattr(client, "_watcher", None)
    if watcher is None:
        return
    log.warning("etcd.watch_stream_reset", prefix=prefix.decode(errors="replace"))
    # Not awaited directly: aetcd's shutdown waits for the stream's handler under `except
    # CancelledError: pass`, which also swallowed a cancel aimed at its caller, and the
    # consumer, its cancellation lost, went on retrying for ever (a process's exit hung on it).
    await _wait_at_most(watcher.shutdown(), RESET_WAIT_S)


def _cancel_abandoned(creating: asyncio.Future[aetcd.Watch]) -> None:
    if creating.cancelled() or creating.exception() is not None:
        return
    _in_background(_cancel_watch(creating.result()))


async def _cancel_watch(watch: aetcd.Watch) -> None:
    # Cancelling asks etcd over the watch stream; if that stream is gone the answer never
    # comes, and a consumer being cancelled must not hang on it.
    await _wait_at_most(watch.cancel(), 2.0)


async def next_change(
    client: aetcd.Client, prefix: bytes, start_revision: int, timeout: float
) -> None:
    """Return at the first change under prefix from start_revision on, or after timeout
    (counted once the watch exists). A compacted start revision counts as a change."""
    compacted = aetcd.exceptions.RevisionCompactedError
    try:
        watch = await _open_watch(client, prefix, start_revision)
    except compacted:
        return
    try:
        with contextlib.suppress(TimeoutError, StopAsyncIteration, compacted):
            await asyncio.wait_for(anext(aiter(watch)), timeout)
    finally:
        await _cancel_watch(watch)


async def watch_prefix(
    client: aetcd.Client,
    prefix: bytes,
    start_revision: int,
    *,
    retry_delay: float = 0.5,
) -> AsyncIterator[WatchEvent]:
    """Events under prefix from start_revision on, forever (cancel the consumer to stop)."""
    next_revision = start_revision
    failures = 0  # in a row, without an event in between
    resync = False
    while True:
        try:
            if resync or failures >= RESYNC_AFTER_FAILURES:
                if failures:
                    log.warning("etcd.watch_resync", prefix=prefix.decode(), failures=failures)
                entries, revision = await list_prefix(client, prefix)
                next_revision, failures, resync = revision + 1, 0, False
                yield Resync(entries, revision)
            watch = await _open_watch(client, prefix, next_revision)
            try:
                async for event in watch:
                    kv = event.kv
                    next_revision, failures = kv.mod_revision + 1, 0
                    if event.kind == aetcd.rtypes.EventKind.PUT:
                        yield Put(_entry(kv))
                    else:
                        yield Delete(kv.key, kv.mod_revision)
            finally:
                await _cancel_watch(watch)
        except aetcd.exceptions.RevisionCompactedError:
            log.info("etcd.watch_compacted", prefix=prefix.decode(), revision=next_revision)
            resync = True
        except (TimeoutError, aetcd.exceptions.ClientError) as exc:
            raise_if_cancelled()
            failures += 1
            log.warning("etcd.watch_broken", prefix=prefix.decode(), error=repr(exc))
            await asyncio.sleep(retry_delay)
