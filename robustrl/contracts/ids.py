"""Ids that travel between roles.

A prompt group's id is `<job id>-g<index>` (index: the dataset cursor, six digits or more); a
trajectory's is `<group id>/<index in the group>`. Ids are stable for life: a group leased
again after its holder died keeps its id, so the trainer de-duplicates what arrives twice.
"""

from __future__ import annotations


def group_id(job_id: str, index: int) -> str:
    return f"{job_id}-g{index:06d}"


def group_index(group: str) -> int:
    return int(group.rsplit("-g", 1)[1])


def parse_group_id(group: str) -> tuple[str, int] | None:
    """(job id, index) of an id that group_id made, else None (another spelling of the same
    number is another id)."""
    job_id, _, digits = group.rpartition("-g")
    if not job_id or not digits.isdigit() or group_id(job_id, int(digits)) != group:
        return None
    return job_id, int(digits)
