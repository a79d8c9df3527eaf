"""Which monitor watches which member: rendezvous hashing over the monitors registered in etcd.

Every member and every monitor computes the same answer from the same registry: a member beats
to the monitor with the highest hash of (monitor, member). When a monitor leaves the registry
only its members move, spread over the others; when one joins, it takes about its share from
each. Nobody stores the assignment, so nothing has to be kept consistent with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _score(monitor_id: str, instance_id: str) -> int:
    digest = hashlib.blake2b(f"{monitor_id}\0{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(instance_id: str, monitor_ids: Iterable[str]) -> list[str]:
    """The monitors in the order `instance_id` prefers them (its owner first)."""
    return sorted(monitor_ids, key=lambda m: (_score(m, instance_id), m), reverse=True)


def owner(instance_id: str, monitor_ids: Iterable[str]) -> str | None:
    """The monitor that watches `instance_id`; None when no monitor is registered."""
    best: tuple[int, str] | None = None
    for monitor_id in monitor_ids:
        score = (_score(monitor_id, instance_id), monitor_id)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]


def assignment_key(role: str, instance_id: str, job_id: str) -> str:
    """What a member is assigned by: its instance id, except that the trainer ranks of a job
    share the job's key, so one monitor sees every rank and can name the one a collective
    waits for."""
    return f"job:{job_id}" if role == "trainer" and job_id else instance_id
