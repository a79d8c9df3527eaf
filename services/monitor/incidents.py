"""Incidents recorded in etcd (<prefix>/incidents/<id>) and streamed from there.

Recording in etcd first and streaming from an etcd watch means every monitor replica, and a
restarted monitor, serves the same incident history, resumable from a revision.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import aetcd
from pydantic import BaseModel

from robustrl.v1 import common_pb2
from services.common.keys import KeySpace
from services.common.registry import ROLE_TO_PROTO
from services.common.watch import Put, Resync, list_prefix, watch_prefix
from services.monitor.detectors import Finding, MemberView


class IncidentRecord(BaseModel):
    incident_id: str
    job_id: str
    role: str
    instance_id: str
    rank: int
    kind: str
    evidence: str
    confidence: float
    detected_at: float
    epoch: int
    step: int = 0
    """The job's step it came at, where that matters (a trainer's reported error)."""


def from_finding(finding: Finding, now: float) -> IncidentRecord:
    return new_incident(finding.view, finding.kind, finding.evidence, finding.confidence, now)


def new_incident(
    view: MemberView, kind: str, evidence: str, confidence: float, now: float, step: int = 0
) -> IncidentRecord:
    return IncidentRecord(
        incident_id=incident_id_at(now),
        job_id=view.job_id,
        role=view.role,
        instance_id=view.instance_id,
        rank=view.rank,
        kind=kind,
        evidence=evidence,
        confidence=confidence,
        detected_at=now,
        epoch=view.epoch,
        step=step,
    )


def incident_id_at(now: float) -> str:
    """A new incident's id. Time-ordered: etcd lists incidents in the order they happened."""
    return f"{int(now * 1000):013d}-{secrets.token_hex(3)}"


def to_proto(record: IncidentRecord) -> common_pb2.Incident:
    out = common_pb2.Incident(
        incident_id=record.incident_id,
        job_id=record.job_id,
        role=ROLE_TO_PROTO.get(record.role, common_pb2.ROLE_UNSPECIFIED),
        instance_id=record.instance_id,
        rank=record.rank,
        kind=common_pb2.IncidentKind.Value(f"INCIDENT_KIND_{record.kind}"),
        evidence=record.evidence,
        confidence=record.confidence,
        epoch=record.epoch,
    )
    out.detected_at.FromNanoseconds(int(record.detected_at * 1e9))
    return out


class IncidentLog:
    def __init__(self, client: aetcd.Client, keys: KeySpace) -> None:
        self.client = client
        self.keys = keys

    async def record(self, incident: IncidentRecord) -> None:
        await self.client.put(
            self.keys.incident(incident.incident_id), incident.model_dump_json().encode()
        )

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
