"""Incidents: what the monitor (or the leader) found failed, as recorded in etcd at
`<prefix>/incidents/<id>` and streamed to the coordinator."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict

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
    model_config = ConfigDict(cache_strings="keys")  # as MemberRecord's

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


def failure_mark(incident: IncidentRecord, lease: int) -> str:
    """The mark of a member's failure: one per binding (job and epoch) of a member in a job,
    one per registration (`lease`) of a free one. Its loss, its hang and its stuck collective
    are one failure: whichever a monitor records first, no monitor records the others."""
    if incident.job_id:
        return _digest("failure", incident.job_id, incident.instance_id, str(incident.epoch))
    return _digest("failure", "", incident.instance_id, f"lease {lease:x}")


def episode_mark(incident: IncidentRecord, episode: str) -> str:
    """The mark of an episode that is not a failure (a NaN counter's value, a slow spell):
    recorded once per binding whichever monitor sees it."""
    return _digest(
        incident.kind, incident.job_id, incident.instance_id, str(incident.epoch), episode
    )


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


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
