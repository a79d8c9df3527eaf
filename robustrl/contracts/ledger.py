"""The work ledger of a job as stored in etcd (`<prefix>/work/<job>`, compressed JSON), and
the pages of dropped groups moved out of it (`<prefix>/dropped/<job>/<n>`).

Only the leader writes them (services/coordinator/work.py holds the transitions); `robustrl
status` and `robustrl dropped` read them.
"""

from __future__ import annotations

import aetcd
from pydantic import BaseModel, Field

from robustrl.contracts import packed
from robustrl.contracts.keys import KeySpace

PAGE_SIZE = 512
"""Dropped groups and take-backs the ledger lists before they move to a page (~60 KB); the
coordinator's `ledger_page_size` setting."""


class Lease(BaseModel):
    instance_id: str
    epoch: int
    deadline: float


class Ask(BaseModel):
    """A holder's last lease ask that got groups: a retry of it (same request id) is answered
    with them again, not with more."""

    request_id: str
    epoch: int
    groups: list[str]


class Holding(BaseModel):
    """Who holds the trajectories of a group the trainer has not made durable yet."""

    holder: str
    """The rollout that delivered it (it keeps them until the trainer commits them)."""
    intake: int
    """`WorkLedger.intake` when it reached the trainer: an older one was lost."""
    step: int = 0
    """The step that trained it (a report's `step`), 0 while it is only delivered."""


class WorkLedger(BaseModel):
    """Stored in etcd at <prefix>/work/<job_id> (compressed JSON, `packed`); only the leader
    writes it."""

    job_id: str
    next_index: int = 0
    open: dict[str, Lease] = Field(default_factory=dict)
    requeued: list[str] = Field(default_factory=list)
    delivered: list[str] = Field(default_factory=list)
    trained: int = 0
    """How many groups were trained (each at most once: the trainer de-duplicates groups)."""
    discarded: dict[str, str] = Field(default_factory=dict)
    """group id -> why it was dropped, since the last page (`pages` holds the earlier ones)."""
    released: dict[str, list[str]] = Field(default_factory=dict)
    """group id -> why it was taken back from a holder (each time) since the last page."""
    dropped: int = 0
    """How many groups were dropped, paged out or not."""
    taken_back: int = 0
    """How many times a group was taken back from a holder, paged out or not."""
    pages: int = 0
    """How many pages of dropped groups and take-backs were moved out (numbered from 0)."""
    held: dict[str, Holding] = Field(default_factory=dict)
    """Delivered groups, and groups trained by a step not yet durable -> who holds them."""
    intake: int = 0
    """How many times the trainer was replaced (each time its intake was lost)."""
    losses: dict[str, int] = Field(default_factory=dict)
    """Group id -> how many of its holders recovery found lost (died or hung) while it was out
    to them, for groups not settled yet (settling removes its entry). Such a group is leased
    alone, so that a loss while it is out is its own; one lost `max_losses` times is a poison
    group (see `release_lost_holder`)."""
    poisoned: int = 0
    """How many groups were dropped as poison groups."""
    asks: dict[str, Ask] = Field(default_factory=dict)
    """Holder -> its last ask that got groups (`lease`'s request_id). One per rollout, dropped
    when the rollout is released."""


class DroppedPage(BaseModel):
    """Dropped groups and take-backs moved out of the ledger, at <prefix>/dropped/<job>/<n>."""

    discarded: dict[str, str]
    released: dict[str, list[str]]


async def dropped_pages(client: aetcd.Client, keys: KeySpace, job_id: str) -> list[DroppedPage]:
    """Every page of dropped groups and take-backs moved out of the job's ledger, in order."""
    rows = sorted(await client.get_prefix(keys.dropped_pages(job_id)), key=lambda kv: kv.key)
    return [packed.load(DroppedPage, kv.value) for kv in rows]
