"""A holder's records in etcd: one HolderRecord per held version, under the lease of this
process's session, so a dead holder drops out with its lease.

A record is written only while the version's manifest is the one the copy matches (the write
is fenced by the manifest's mod revision), and withdrawn when the copy is dropped. Its pullers
count is a hint for pullers spreading their load: a change is written PULLERS_RECORD_DELAY_S
later, or at once when the holder fills up or frees its last slot (pullers skip a holder whose
record says full). When the manifest of a held version is written again, the copy is kept
under the new manifest if it has the same contents (a restored trainer published its
checkpoint's version again, bit for bit), else dropped. If the session's lease is lost (etcd
away longer than its TTL), a new session is opened and every held version registered again.
"""

from __future__ import annotations

import asyncio

import aetcd

from robustrl.contracts.keys import WeightKeys
from robustrl.core.logs import get_logger
from robustrl.core.session import Session, lease_gone
from robustrl.weights.protocol import ROLE_RELAY, HolderRecord
from robustrl.weights.transport import WeightIntegrityError
from robustrl.weights.ucx.counters import TransferCounters
from robustrl.weights.ucx.directory import VersionDirectory
from robustrl.weights.ucx.held import HeldVersion, HeldVersions
from robustrl.weights.ucx.lifetime import Lifetime

log = get_logger(__name__)

PULLERS_RECORD_DELAY_S = 0.05
"""How long a holder waits before writing a change in its pullers count to its etcd record;
every change in that time takes one write, and none if the count is back where the record has
it: a write at each request's start and end slowed the pulls it served (docs/decisions/0111)."""


class HolderRecords:
    """This process's holder records, kept true to `held`. It is also what the directory's
    watch tells of held manifests that go or change (directory.HeldManifests)."""

    def __init__(
        self,
        client: aetcd.Client,
        wkeys: WeightKeys,
        job_id: str,
        *,
        instance_id: str,
        held: HeldVersions,
        directory: VersionDirectory,
        counters: TransferCounters,
        lifetime: Lifetime,
        max_pullers: int,
        record_delay: float,
        session_ttl: int,
    ) -> None:
        self._client = client
        self._wkeys = wkeys
        self._job_id = job_id
        self._instance_id = instance_id
        self._held = held
        self._directory = directory
        self._counters = counters
        self._lifetime = lifetime
        self.max_pullers = max_pullers
        self.record_delay = record_delay
        self.session_ttl = session_ttl
        self.session: Session | None = None
        self.address = ""  # host:port of this process's UCX listener, once it listens
        self._lock = asyncio.Lock()
        self._due: set[int] = set()  # versions with a pullers count write scheduled

    async def open(self, address: str) -> None:
        """Open the session records are written under; `address` goes in every record."""
        self.address = address
        self.session = await Session.open(self._client, self.session_ttl)

    async def close(self) -> None:
        """Revoke the session's lease: every record goes at once."""
        if self.session is not None:
            await self.session.close()

    def _record(self, held: HeldVersion) -> HolderRecord:
        return HolderRecord(
            instance_id=self._instance_id,
            address=self.address,
            role=held.role,
            trainer_epoch=held.manifest.trainer_epoch,
            digest=held.manifest.digest,
            active_pullers=held.active_pullers,
            max_pullers=self.max_pullers,
            first_bucket=held.first_bucket,
            stop_bucket=held.stop_bucket,
        )

    async def register(self, version: int) -> None:
        """Write our holder record for version, only while its manifest is the one we hold."""
        async with self._lock:
            held = self._held.get(version)
            if held is None or self.session is None or self._lifetime.closed:
                return
            tx = self._client.transactions
            manifest_key = self._wkeys.manifest(self._job_id, version)
            record = self._record(held)
            try:
                ok, _ = await self._client.transaction(
                    compare=[tx.mod(manifest_key) == held.manifest_revision],
                    success=[
                        tx.put(
                            self._wkeys.holder(self._job_id, version, self._instance_id),
                            record.to_json(),
                            lease=self.session.lease_id,
                        )
                    ],
                    failure=[],
                )
            except aetcd.exceptions.ClientError as exc:
                if not lease_gone(exc):
                    raise
                # The session lapsed (etcd was unreachable past its TTL) and its keepalive has
                # not noticed yet: `keep_session` opens the next one and registers every held
                # version under it, this one included.
                log.info("weights.record_deferred", version=version, reason="lease gone")
                return
            if ok:
                held.recorded_pullers = record.active_pullers
                self._counters.records_written += 1
                if self._lags_cap(held):
                    # The holder filled up or freed its slot while this write was under way (a
                    # pull shorter than an etcd write): say so at once, not record_delay later.
                    self.schedule(version)
        if not ok and held is self._held.get(version):
            # Deleted (GC), or written again after we read it: by a restored trainer, maybe
            # with the bytes we hold (a pull that finished from its standby does) and kept.
            await self.current(held)

    def schedule(self, version: int) -> None:
        """Register `version` in the background."""
        self._lifetime.start(self._register_quietly(version))

    def pullers_changed(self, held: HeldVersion) -> None:
        """Bring our record's pullers count up to date: at once if the holder just filled up
        or freed its last slot (pullers skip a full holder and wait for a busy one's record to
        change), else record_delay later (see PULLERS_RECORD_DELAY_S)."""
        version = held.manifest.version
        if self._lags_cap(held):
            self.schedule(version)
        elif version not in self._due:
            self._due.add(version)
            self._lifetime.start(self._record_pullers_later(version))

    def _lags_cap(self, held: HeldVersion) -> bool:
        """Whether our record says full where we are not, or the other way round."""
        cap = self.max_pullers
        return bool(cap) and (held.active_pullers >= cap) != (held.recorded_pullers >= cap)

    async def _record_pullers_later(self, version: int) -> None:
        try:
            await asyncio.sleep(self.record_delay)
        finally:
            self._due.discard(version)
        held = self._held.get(version)
        if held is not None and held.active_pullers != held.recorded_pullers:
            await self._register_quietly(version)
        self._counters.pullers_checks += 1

    async def _register_quietly(self, version: int) -> None:
        # The pullers count is a hint for load spreading; a failed update must not fail serving.
        try:
            await self.register(version)
        except aetcd.exceptions.ClientError as exc:
            log.info("weights.record_update_failed", version=version, error=repr(exc)[:200])

    def forget(self, version: int) -> None:
        """A held version was dropped: withdraw its record (in the background)."""
        if not self._lifetime.closed:
            self._lifetime.start(self._unregister(version))

    async def _unregister(self, version: int) -> None:
        """Delete our holder record of a dropped version (GC may have deleted it already)."""
        async with self._lock:
            if version in self._held:
                return  # held again meanwhile: the record is current
            try:
                await self._client.delete(
                    self._wkeys.holder(self._job_id, version, self._instance_id)
                )
            except aetcd.exceptions.ClientError as exc:
                # It still goes with our lease; pullers skip records they cannot use.
                log.info("weights.unregister_failed", version=version, error=repr(exc)[:200])

    async def keep_session(self) -> None:
        """If the lease is lost (etcd away longer than its TTL), open a new one and register
        the held versions again, so this holder comes back once etcd does."""
        while not self._lifetime.closed:
            assert self.session is not None
            await self.session.done.wait()
            if self._lifetime.closed:
                return
            log.warning("weights.session_lost", job=self._job_id)
            delay = 0.2
            while not self._lifetime.closed:
                try:
                    self.session = await Session.open(self._client, self.session_ttl)
                    for version in self._held.versions():
                        await self.register(version)
                    break
                except aetcd.exceptions.ClientError as exc:
                    log.info("weights.session_retry", error=repr(exc)[:200])
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ held manifests

    def manifest_revisions(self) -> dict[int, int]:
        return self._held.manifest_revisions()

    def drop(self, version: int, reason: str) -> None:
        self._held.drop(version, reason)

    async def current(self, held: HeldVersion) -> HeldVersion | None:
        """Our copy of a version once checked against its manifest in etcd: the announcement
        of a newer trainer epoch can come before our watch's event of the manifest written
        with it, and the copy of the older epoch is kept only if it has the same contents
        (see republished). Likewise when our holder record could not be written because the
        manifest changed after we read it."""
        version = held.manifest.version
        now = await self._directory.manifest_now(version)
        if self._held.get(version) is not held:
            return self._held.get(version)  # the watch acted meanwhile
        if now is None:
            self._held.drop(version, "superseded")
        elif now[1] > held.manifest_revision:
            self.republished(version, *now)
        return self._held.get(version)

    def republished(self, version: int, raw: bytes, revision: int) -> None:
        """The manifest of a version we hold was written again: a relay whose copy has the new
        manifest's contents (a restored trainer published its checkpoint's version again, bit
        for bit) serves it under the new manifest; anything else is dropped, as is a manifest
        from an epoch older than the newest seen. The trainer that published the old one is
        fenced by the new epoch and never keeps it."""
        held = self._held.get(version)
        assert held is not None
        directory = self._directory
        try:
            manifest = directory.manifest(raw)
        except WeightIntegrityError as exc:
            log.warning("weights.bad_manifest", version=version, error=str(exc)[:200])
            manifest = None
        same = (
            manifest is not None
            and held.role == ROLE_RELAY
            and manifest.digest == held.manifest.digest
            and manifest.trainer_epoch >= max(held.manifest.trainer_epoch, directory.highest_epoch)
        )
        if manifest is None or not same:
            self._held.drop(version, "manifest_changed")
            return
        held.manifest = manifest
        held.manifest_revision = revision
        directory.highest_epoch = manifest.trainer_epoch
        self._counters.versions_kept += 1
        log.info(
            "weights.kept",
            job=self._job_id,
            version=version,
            epoch=manifest.trainer_epoch,
            reason="republished with the same contents",
        )
        # Our record says the old epoch, and its write is fenced by the old revision: the new
        # one is written under the new revision.
        self.schedule(version)
