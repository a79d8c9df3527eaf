"""Incidents from the detectors' findings."""

from __future__ import annotations

from robustrl.contracts.incidents import IncidentRecord, new_incident
from services.monitor.detectors import Finding


def from_finding(finding: Finding, now: float) -> IncidentRecord:
    return new_incident(finding.view, finding.kind, finding.evidence, finding.confidence, now)
