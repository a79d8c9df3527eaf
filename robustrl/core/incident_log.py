"""The incident log in etcd (`<prefix>/incidents/<id>`): recorded by the monitor and the
leader, followed by the leader's recovery executor and by `WatchIncidents`.

Recording in etcd first and streaming from an etcd watch means every monitor replica, and a
restarted monitor, serves the same incident history, resumable from a revision.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import aetcd

from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.keys import KeySpace
from robustrl.core.watch import Put, Resync, list_prefix, watch_prefix

MARKS_PER_TXN = 40
"""Incidents per transaction in `record_once` (three operations each; etcd allows 128)."""


class IncidentLog:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys

    async def record(self, incident: IncidentRecord) -> None:
        await self.client.put(
            self.keys.incident(incident.incident_id), incident.model_dump_json().encode()
        )

    async def record_once(
        self, marked: Sequence[tuple[str, IncidentRecord]], lease: int
    ) -> list[IncidentRecord]:
        """Record each incident whose mark (a digest naming the failure) no one has recorded
        yet, with its mark under `lease`, in as few transactions as etcd allows; the ones
        recorded. Two monitors that find the same failure thus record it once."""
        recorded: list[IncidentRecord] = []
        for start in range(0, len(marked), MARKS_PER_TXN):
            pending = list(marked[start : start + MARKS_PER_TXN])
            while pending:
                tx = self.client.transactions
                marks = [self.keys.incident_mark(mark) for mark, _ in pending]
                ok, responses = await self.client.transaction(
                    compare=[tx.version(key) == 0 for key in marks],
                    success=[
                        op
                        for key, (_, record) in zip(marks, pending, strict=True)
                        for op in (
                            tx.put(key, record.incident_id.encode(), lease=lease),
                            tx.put(
                                self.keys.incident(record.incident_id),
                                record.model_dump_json().encode(),
                            ),
                        )
                    ],
                    failure=[tx.get(key) for key in marks],
                )
                if ok:
                    recorded += [record for _, record in pending]
                    break
                pending = [
                    item for item, found in zip(pending, responses, strict=True) if not found
                ]
        return recorded

    async def list(self, job_id: str = "", kind: str = "") -> tuple[list[IncidentRecord], int]:
        """The incidents recorded (of `job_id`, of `kind`: "" for all), oldest first."""
        entries, revision = await list_prefix(self.client, self.keys.incidents())
        records = [IncidentRecord.model_validate_json(e.value) for e in entries]
        return [
            r
            for r in records
            if (not job_id or r.job_id == job_id) and (not kind or r.kind == kind)
        ], revision

    async def follow(self, job_id: str, after_revision: int) -> AsyncIterator[IncidentRecord]:
        """Incidents recorded after after_revision (0: from now on), as they are recorded."""
        if after_revision <= 0:
            _, after_revision = await list_prefix(self.client, self.keys.incidents())
        seen: set[str] = set()
        async for event in watch_prefix(self.client, self.keys.incidents(), after_revision + 1):
            entries = [event.entry] if isinstance(event, Put) else []
            if isinstance(event, Resync):
                entries = event.entries
            for entry in entries:
                record = IncidentRecord.model_validate_json(entry.value)
                if record.incident_id in seen or (job_id and record.job_id != job_id):
                    continue
                seen.add(record.incident_id)
                yield record
