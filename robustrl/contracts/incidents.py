"""Incidents: what the monitor (or the leader) found failed, as recorded in etcd at
`<prefix>/incidents/<id>` and streamed to the coordinator."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from robustrl.contracts.roles import ROLE_TO_PROTO, IncidentKind
from robustrl.v1 import common_pb2


class Subject(Protocol):
    """The member an incident is about, as the reporter knows it."""

    @property
    def job_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def epoch(self) -> int: ...


@dataclass(frozen=True)
class IncidentSubject:
    """A Subject for a reporter that keeps no view of the member (the leader)."""

    job_id: str
    role: str
    instance_id: str
    epoch: int
    rank: int = 0


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


def new_incident(
    subject: Subject, kind: str, evidence: str, confidence: float, now: float, step: int = 0
) -> IncidentRecord:
    return IncidentRecord(
        incident_id=incident_id_at(now),
        job_id=subject.job_id,
        role=subject.role,
        instance_id=subject.instance_id,
        rank=subject.rank,
        kind=kind,
        evidence=evidence,
        confidence=confidence,
        detected_at=now,
        epoch=subject.epoch,
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
        kind=IncidentKind(record.kind).to_proto(),
        evidence=record.evidence,
        confidence=record.confidence,
        epoch=record.epoch,
    )
    out.detected_at.FromNanoseconds(int(record.detected_at * 1e9))
    return out
