"""The version directory: a job's weight versions in etcd (each version's manifest and the
holder records under it, protocol.py), as one UCX transport reads and watches them.

A process keeps one watch on the job's versions. It keeps a view of them (`VersionsView`), so
a pull's first look at a version costs no etcd read; it tells pulls when the holder they
receive from deletes its record (`Departures`); and it tells the holder side when the manifest
of a version it holds is deleted (garbage collection) or written again (a newer trainer epoch),
through the narrow `HeldManifests` interface. The trainer's publish deletes versions older than
the newest keep_versions (`collect_garbage`). A manifest from an older trainer epoch than the
highest this process has seen is never pulled (a fenced trainer's late publish).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

import aetcd

from robustrl.contracts.keys import WeightKeys
from robustrl.core.logs import get_logger
from robustrl.core.watch import (
    Delete,
    Entry,
    Put,
    Resync,
    list_prefix,
    next_change,
    watch_prefix,
)
from robustrl.weights.protocol import BucketManifest, HolderRecord
from robustrl.weights.transport import WeightIntegrityError
from robustrl.weights.ucx.counters import TransferCounters

log = get_logger(__name__)

PARSED_MANIFESTS = 8
"""Manifests a directory keeps parsed (`VersionDirectory.manifest`): a pull, the watch and the
checks of a stranded pull each want the same one (docs/decisions/0111)."""

VersionListing = tuple[BucketManifest, int, tuple[list[HolderRecord], int]]
"""A version's manifest, its mod revision, and its holders with the revision they were listed
at."""


class WeightUnavailable(WeightIntegrityError):
    """The version cannot be pulled now: no manifest, stale epoch, or no holder could serve it.

    A WeightIntegrityError so existing callers that retry on integrity errors (and never load
    what failed) handle it without change.
    """


class HeldManifests(Protocol):
    """What the watch needs of the holder side: the versions held, and what to do when their
    manifest goes or changes."""

    def manifest_revisions(self) -> dict[int, int]:
        """Each held version and the revision of the manifest its copy matches."""

    def drop(self, version: int, reason: str) -> None: ...

    def republished(self, version: int, raw: bytes, revision: int) -> None: ...


def changes_held_manifest(held_revision: int, event: Put | Delete) -> bool:
    """Whether a watched event on the manifest of a version we hold (written or read at
    `held_revision`) means what is published is no longer what we hold: a write or a delete
    after it. An earlier event is history that the held revision already replaced. It does
    come: a manifest write that timed out (etcd stalled) can still land, and the publish
    retried writes it again; the first write's event then arrives after the second was held,
    and must not drop the version just published (docs/decisions/0113)."""
    revision = event.revision if isinstance(event, Delete) else event.entry.mod_revision
    return revision > held_revision


class Departures:
    """Holder records deleted while pulls receive from them, as the transport's watch of the
    job's versions sees them: each pull waits on the event of the holder it receives from."""

    def __init__(self) -> None:
        # (version, holder) -> (revision the holder was listed at, event)
        self._events: dict[tuple[int, str], tuple[int, asyncio.Event]] = {}

    def watch(self, version: int, instance_id: str, listed_at: int) -> asyncio.Event:
        event = asyncio.Event()
        self._events[(version, instance_id)] = (listed_at, event)
        return event

    def unwatch(self, version: int, instance_id: str) -> None:
        self._events.pop((version, instance_id), None)

    def watched(self) -> list[tuple[int, str]]:
        return list(self._events)

    def left(self, version: int, instance_id: str, revision: int) -> None:
        """The record was deleted at `revision`. A deletion from before the listing the pull
        chose the holder from does not count: the holder had registered again since."""
        watched = self._events.get((version, instance_id))
        if watched is not None and revision > watched[0]:
            watched[1].set()


class VersionsView:
    """The job's weight records (every version's manifest and holder records) as the
    transport's own watch last delivered them, and the etcd revision they stand at.

    A pull takes its first look at a version from here instead of reading etcd: the watch
    runs anyway, and with N rollouts a read per pull is N range reads per version, each
    listing N holders (docs/decisions/0111). The view can lag etcd by the watch's delivery, the
    same staleness any listing has by the time it is used: a version it does not hold yet is
    read from etcd, and a pull re-lists from etcd once a holder fails it.
    """

    def __init__(self, wkeys: WeightKeys, job_id: str) -> None:
        self._wkeys = wkeys
        self._job_id = job_id
        self._entries: dict[bytes, Entry] = {}
        self.revision = 0  # 0 until the first listing arrives: nothing can be answered

    def reset(self, entries: Sequence[Entry], revision: int) -> None:
        self._entries = {e.key: e for e in entries}
        self.revision = revision

    def apply(self, event: Put | Delete | Resync) -> None:
        if isinstance(event, Resync):
            self.reset(event.entries, event.revision)
        elif isinstance(event, Put):
            self._entries[event.entry.key] = event.entry
            self.revision = max(self.revision, event.entry.mod_revision)
        else:
            self._entries.pop(event.key, None)
            self.revision = max(self.revision, event.revision)

    def version(self, version: int) -> tuple[list[Entry], int] | None:
        """The records of `version` and the revision they stand at, or None if the view has
        not seen its manifest (not listed yet, or not yet delivered by the watch)."""
        if self.revision == 0 or self._wkeys.manifest(self._job_id, version) not in self._entries:
            return None
        prefix = self._wkeys.version(self._job_id, version)
        return [e for k, e in self._entries.items() if k.startswith(prefix)], self.revision

    def versions(self) -> dict[int, list[str]]:
        """Each version whose manifest the view holds, with the holders it lists for it."""
        parsed = [p for key in self._entries if (p := self._wkeys.parse(self._job_id, key))]
        listed: dict[int, list[str]] = {v: [] for v, rest in parsed if rest == "manifest"}
        for version, rest in parsed:
            holder = rest.removeprefix("holders/")
            if version in listed and holder != rest:
                listed[version].append(holder)
        return {v: sorted(listed[v]) for v in sorted(listed)}


class VersionDirectory:
    """One transport's reader of its job's versions in etcd: manifests (parsed once), holders
    of exactly a manifest's contents (others than this process), the highest trainer epoch seen,
    and the watch that keeps `view` and `departures`."""

    def __init__(
        self,
        client: aetcd.Client,
        wkeys: WeightKeys,
        job_id: str,
        *,
        instance_id: str,
        counters: TransferCounters,
    ) -> None:
        self._client = client
        self._wkeys = wkeys
        self._job_id = job_id
        self._instance_id = instance_id
        self._counters = counters
        self.highest_epoch = 0  # of trainer epochs seen in manifests and announcements
        self.view = VersionsView(wkeys, job_id)
        self.departures = Departures()
        self._parsed: dict[bytes, BucketManifest] = {}  # raw manifest -> parsed (manifest)

    def saw_epoch(self, epoch: int) -> None:
        self.highest_epoch = max(self.highest_epoch, epoch)

    def manifest(self, raw: bytes) -> BucketManifest:
        """BucketManifest.from_json of `raw`, parsed once while it is among the last
        PARSED_MANIFESTS seen (the watch parses each new one as it arrives, off the path of
        the pull that follows)."""
        manifest = self._parsed.get(raw)
        if manifest is None:
            manifest = self._parsed[raw] = BucketManifest.from_json(raw)
            self._counters.manifests_parsed += 1
            while len(self._parsed) > PARSED_MANIFESTS:
                del self._parsed[next(iter(self._parsed))]
        return manifest

    async def manifest_now(self, version: int) -> tuple[bytes, int] | None:
        """The manifest of `version` as etcd has it now, with its mod revision (one read)."""
        got = await self._client.get(self._wkeys.manifest(self._job_id, version))
        return None if got is None else (got.value, got.mod_revision)

    async def read_version(self, version: int) -> VersionListing:
        """The manifest of this job's version, its mod revision, and its holders with the etcd
        revision they were listed at: from the view if it has the version, else one range read
        (the holders' keys sit under the version's). A view that lists no holder that is not
        full has its holders listed again from etcd.

        The view can hold a manifest a moment before its publisher's holder record: a pull
        that took that for the whole listing would wait for a holder, or give the version up
        as stranded if a newer one exists. It can also hold a manifest a moment after a newer
        trainer epoch replaced it; etcd is read then too.
        """
        seen = self.view.version(version)
        if seen is not None:
            try:
                manifest, revision, (holders, listed_at) = self._parse_version(version, *seen)
            except WeightUnavailable:
                # From an older trainer epoch than announced: the view has not had the event
                # of a restored trainer's manifest yet, and etcd may have it already.
                seen = None
        if seen is None:
            entries, listed_at = await list_prefix(
                self._client, self._wkeys.version(self._job_id, version)
            )
            self._counters.etcd_reads += 1
            return self._parse_version(version, entries, listed_at)
        if not any(not h.full for h in holders):
            holders, listed_at = await self.list_holders(manifest)
        return manifest, revision, (holders, listed_at)

    def _parse_version(self, version: int, entries: list[Entry], listed_at: int) -> VersionListing:
        """read_version's answer from a listing of the version's keys."""
        job_id = self._job_id
        key = self._wkeys.manifest(job_id, version)
        found = next((e for e in entries if e.key == key), None)
        if found is None:
            raise WeightUnavailable(f"no manifest for version {version} of job {job_id}")
        manifest = self.manifest(found.value)
        if manifest.trainer_epoch < self.highest_epoch:
            raise WeightUnavailable(
                f"version {version} of job {job_id} comes from trainer epoch "
                f"{manifest.trainer_epoch}, older than epoch {self.highest_epoch}: ignored"
            )
        self.highest_epoch = manifest.trainer_epoch
        holders = self._holders_of(manifest, [e for e in entries if e.key != key])
        return manifest, found.mod_revision, (holders, listed_at)

    async def list_holders(self, manifest: BucketManifest) -> tuple[list[HolderRecord], int]:
        """Holders of exactly this manifest's contents, and the etcd revision of the list."""
        entries, revision = await list_prefix(
            self._client, self._wkeys.holders(manifest.job_id, manifest.version)
        )
        self._counters.etcd_reads += 1
        return self._holders_of(manifest, entries), revision

    def _holders_of(self, manifest: BucketManifest, entries: list[Entry]) -> list[HolderRecord]:
        holders = []
        for entry in entries:
            record = HolderRecord.from_json(entry.value)
            if record.digest == manifest.digest and record.instance_id != self._instance_id:
                holders.append(record)
        return holders

    async def superseded(self, manifest: BucketManifest, manifest_revision: int) -> str | None:
        """Why pulling `manifest` no longer makes sense, or None: its manifest was deleted or
        replaced (a restored trainer republished the version), or a newer version or trainer
        epoch was published. A pull that has lost every holder stops then instead of waiting
        out pull_timeout for holders that will never come back."""
        entries, _ = await list_prefix(self._client, self._wkeys.versions(manifest.job_id))
        self._counters.etcd_reads += 1
        found = False
        for entry in entries:
            parsed = self._wkeys.parse(manifest.job_id, entry.key)
            if parsed is None or parsed[1] != "manifest":
                continue
            if parsed[0] == manifest.version:
                found = True
                if entry.mod_revision != manifest_revision:
                    return "its manifest was replaced"
                continue
            other = self.manifest(entry.value)
            if (other.trainer_epoch, other.version) > (manifest.trainer_epoch, manifest.version):
                return f"version {other.version} of trainer epoch {other.trainer_epoch} is newer"
        return None if found else "its manifest was deleted"

    async def wait_for_holders(
        self, manifest: BucketManifest, revision: int, timeout: float, *, any_version: bool = False
    ) -> None:
        """Until a holder record of this version changes after `revision` (a relay appears, a
        busy holder frees a slot) or timeout: react at once, without polling etcd. With
        `any_version`, any change under the job's versions (a new manifest) wakes it too."""
        if any_version:
            prefix = self._wkeys.versions(manifest.job_id)
        else:
            prefix = self._wkeys.holders(manifest.job_id, manifest.version)
        await next_change(self._client, prefix, revision + 1, max(timeout, 0.01))

    async def latest_version(self) -> int | None:
        """The newest version whose manifest comes from the highest trainer epoch seen."""
        entries, _ = await list_prefix(self._client, self._wkeys.versions(self._job_id))
        manifests: list[BucketManifest] = []
        for entry in entries:
            parsed = self._wkeys.parse(self._job_id, entry.key)
            if parsed is not None and parsed[1] == "manifest":
                manifests.append(self.manifest(entry.value))
        if not manifests:
            return None
        self.highest_epoch = max(self.highest_epoch, *(m.trainer_epoch for m in manifests))
        current = [m.version for m in manifests if m.trainer_epoch >= self.highest_epoch]
        return max(current) if current else None

    async def collect_garbage(self, newest: int, keep_versions: int) -> None:
        """Delete the etcd keys of versions older than the newest keep_versions."""
        entries, _ = await list_prefix(self._client, self._wkeys.versions(self._job_id))
        versions = sorted(
            {
                parsed[0]
                for e in entries
                if (parsed := self._wkeys.parse(self._job_id, e.key)) and parsed[1] == "manifest"
            }
        )
        for version in versions[:-keep_versions]:
            if version < newest:
                await self._client.delete_prefix(self._wkeys.version(self._job_id, version))
                log.info("weights.gc", job=self._job_id, version=version)

    async def watch(self, held: HeldManifests) -> None:
        """Keep the view of the job's weight records; tell `held` of held versions whose
        manifest was deleted (GC) or replaced (newer epoch); tell pulls of holder records that
        go. Runs until cancelled."""
        prefix = self._wkeys.versions(self._job_id)
        entries, revision = await list_prefix(self._client, prefix)
        self.view.reset(entries, revision)
        async for event in watch_prefix(self._client, prefix, revision + 1):
            self.view.apply(event)
            if isinstance(event, Resync):
                self._resync(event, held)
                continue
            key = event.entry.key if isinstance(event, Put) else event.key
            parsed = self._wkeys.parse(self._job_id, key)
            if parsed is not None and isinstance(event, Delete):
                holder = parsed[1].removeprefix("holders/")
                if holder != parsed[1]:
                    self.departures.left(parsed[0], holder, event.revision)
                    continue
            if parsed is None or parsed[1] != "manifest":
                continue
            version = parsed[0]
            held_revision = held.manifest_revisions().get(version)
            if held_revision is None:
                if isinstance(event, Put):
                    # Parsed now, before a pull of it asks (a bad one is reported by that pull).
                    with contextlib.suppress(WeightIntegrityError):
                        self.manifest(event.entry.value)
                continue
            if not changes_held_manifest(held_revision, event):
                continue
            if isinstance(event, Delete):
                held.drop(version, "superseded")
            else:
                held.republished(version, event.entry.value, event.entry.mod_revision)

    def _resync(self, event: Resync, held: HeldManifests) -> None:
        """The watch re-listed the job's versions (its history was compacted): departures and
        held manifests are checked against the listing."""
        present = {self._wkeys.parse(self._job_id, e.key) for e in event.entries}
        for version, instance_id in self.departures.watched():
            if (version, f"holders/{instance_id}") not in present:
                self.departures.left(version, instance_id, event.revision)
        manifests = {
            parsed[0]: e
            for e in event.entries
            if (parsed := self._wkeys.parse(self._job_id, e.key)) and parsed[1] == "manifest"
        }
        for version, held_revision in held.manifest_revisions().items():
            if held_revision > event.revision:
                continue  # written after this listing: the events after it tell
            now = manifests.get(version)
            if now is None:
                held.drop(version, "superseded")
            elif now.mod_revision != held_revision:
                held.republished(version, now.value, now.mod_revision)
