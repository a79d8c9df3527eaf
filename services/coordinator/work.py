"""The work ledger of a running job: which prompt groups are leased to whom, delivered,
trained or dropped — and the pure functions that move groups between those states.

    new (dataset cursor) --lease--> open --complete--> delivered --progress--> trained
                       requeued <--expire / holder lost--   \\--progress--> discarded (why)

A group keeps its id for life; trajectory ids derive from it, so a group leased again after
its holder died de-duplicates at the trainer against whatever already arrived. Backpressure:
at most `budget` groups are open or delivered-but-untrained at once, so nothing waits long
enough to exceed the staleness bound.

The ledger stays small however long the job runs: groups are numbered by the dataset cursor,
so "every group below `next_index` that is not open, requeued, delivered or discarded was
trained" — trained groups are counted, not listed (the trainer's trained.jsonl lists them).
Dropped groups and take-backs are listed, with why, but only the latest: once there are
`PAGE_SIZE` of them, `page_out` moves them to a page of their own (stored beside the ledger,
in the same write), so the ledger, which the leader rewrites on every lease, never grows
towards etcd's size limit on a job that drops groups for days.

Who still holds a group's trajectories: its rollout keeps them until the trainer commits them
(its checkpoint has the step that trained them). So a delivered group, or one trained by a
step not yet durable, is in `held` with its rollout and the trainer intake it went to. When
the trainer is replaced (`trainer_replaced`), its intake and the steps after its last durable
checkpoint are gone: the new trainer's first report (`durable` = its restored step) turns the
groups of those lost steps back into delivered ones, and a delivered group of a lost intake
whose rollout is gone as well is held by nobody: `release_lost` leases it again.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from robustrl.contracts.ids import group_id, parse_group_id
from robustrl.contracts.ledger import PAGE_SIZE, Ask, DroppedPage, Holding, Lease, WorkLedger
from services.coordinator.policy.verdicts import leased_alone, poison_group


def page_out(
    ledger: WorkLedger, page_size: int = PAGE_SIZE
) -> tuple[WorkLedger, DroppedPage] | None:
    """Once the ledger lists `page_size` dropped groups and take-backs: the ledger with them
    moved out, and the page that holds them (number `ledger.pages`). None while it lists
    fewer. Leaves `ledger` as it is: the caller stores both in one write, then adopts the
    new ledger."""
    if len(ledger.discarded) + len(ledger.released) < page_size:
        return None
    page = DroppedPage(
        discarded=dict(ledger.discarded),
        released={group: list(why) for group, why in ledger.released.items()},
    )
    moved = ledger.model_copy(update={"discarded": {}, "released": {}, "pages": ledger.pages + 1})
    return moved, page


def forget_paged(ledger: WorkLedger, page: DroppedPage, pages: int) -> None:
    """Once `page_out`'s page is stored: the ledger lets go of what the page holds and counts
    `pages`. Only of that: groups dropped or taken back while the write was in flight stay
    listed (a take-back of a paged group keeps the reasons after those paged)."""
    for group in page.discarded:
        ledger.discarded.pop(group, None)
    for group, paged in page.released.items():
        rest = ledger.released.pop(group, [])[len(paged) :]
        if rest:
            ledger.released[group] = rest
    ledger.pages = pages


def retried_ask(ledger: WorkLedger, instance_id: str, epoch: int, request_id: str) -> Ask | None:
    """The ask that this request retries (same non-empty request id and epoch: its answer
    never arrived), or None for a new ask."""
    ask = ledger.asks.get(instance_id)
    if request_id and ask and (ask.request_id, ask.epoch) == (request_id, epoch):
        return ask
    return None


def lease(
    ledger: WorkLedger,
    *,
    instance_id: str,
    epoch: int,
    max_groups: int,
    budget: int,
    now: float,
    lease_seconds: float,
    request_id: str = "",
) -> list[str]:
    """Lease up to max_groups (requeued first, then new ones) within the budget. A group whose
    holder was lost before goes out alone (see `WorkLedger.losses`). A retry of an ask that
    already got groups (`retried_ask`) gets those of them still open to it, with their deadline
    renewed, and nothing more. Mutates."""
    if ask := retried_ask(ledger, instance_id, epoch, request_id):
        mine = set(_leased_to(ledger, instance_id))
        again = [g for g in ask.groups if g in mine]
        for group in again:
            ledger.open[group].deadline = now + lease_seconds
        return again
    granted: list[str] = []
    room = budget - len(ledger.open) - len(ledger.delivered)
    while len(granted) < min(max_groups, room):
        alone = False
        if ledger.requeued:
            alone = leased_alone(ledger.requeued[0], ledger.losses)
            if alone and granted:
                break
            group = ledger.requeued.pop(0)
        else:
            group = group_id(ledger.job_id, ledger.next_index)
            ledger.next_index += 1
        ledger.open[group] = Lease(
            instance_id=instance_id, epoch=epoch, deadline=now + lease_seconds
        )
        granted.append(group)
        if alone:
            break
    if request_id and granted:
        ledger.asks[instance_id] = Ask(request_id=request_id, epoch=epoch, groups=granted)
    return granted


def unlease(ledger: WorkLedger, instance_id: str, group_ids: list[str]) -> list[str]:
    """Undo a lease whose answer never reached its holder (the write that stored it failed,
    or the caller went away): the groups it still holds go back to the front of the queue,
    in their order, without counting as taken back. Returns them. Mutates."""
    back = [g for g in group_ids if (h := ledger.open.get(g)) and h.instance_id == instance_id]
    for group in back:
        del ledger.open[group]
    ask = ledger.asks.get(instance_id)
    if ask and set(ask.groups) <= set(group_ids):
        del ledger.asks[instance_id]  # its retry is a new ask
    ledger.requeued[:0] = [g for g in back if g not in ledger.requeued]
    return back


def complete(ledger: WorkLedger, instance_id: str, group_ids: list[str]) -> list[str]:
    """Mark the holder's open groups delivered; returns the ids it did not hold. Mutates.

    A group it no longer holds was taken back (the completion of a zombie changes nothing)
    or is already settled (trained before its completion arrived): either way, ignored.
    """
    ignored: list[str] = []
    for group in group_ids:
        held = ledger.open.get(group)
        if held is None or held.instance_id != instance_id:
            ignored.append(group)
            continue
        del ledger.open[group]
        ledger.delivered.append(group)
        ledger.held[group] = Holding(holder=instance_id, intake=ledger.intake)
    return ignored


def take_back(ledger: WorkLedger, group: str, reason: str) -> None:
    ledger.open.pop(group, None)
    ledger.held.pop(group, None)
    if group in ledger.delivered:
        ledger.delivered.remove(group)
    if group not in ledger.requeued:
        ledger.requeued.append(group)
    ledger.released.setdefault(group, []).append(reason)
    ledger.taken_back += 1


def _drop(ledger: WorkLedger, group: str, why: str) -> None:
    ledger.held.pop(group, None)
    ledger.losses.pop(group, None)
    ledger.discarded[group] = why
    ledger.dropped += 1


def give_back(ledger: WorkLedger, instance_id: str, groups: dict[str, str]) -> list[str]:
    """The holder returns these open groups unfinished (group -> why): requeue them. Groups it
    does not hold are ignored and returned. Mutates."""
    ignored = []
    for group, why in groups.items():
        held = ledger.open.get(group)
        if held is None or held.instance_id != instance_id:
            ignored.append(group)
            continue
        take_back(ledger, group, f"{instance_id} gave it back: {why}")
    return ignored


def _leased_to(ledger: WorkLedger, instance_id: str) -> list[str]:
    return [g for g, held in ledger.open.items() if held.instance_id == instance_id]


def release_holder(ledger: WorkLedger, instance_id: str, reason: str) -> list[str]:
    """Requeue every open lease of instance_id, which left the registry (it may only have let
    its session lapse: not counted as a loss). Mutates."""
    groups = _leased_to(ledger, instance_id)
    for group in groups:
        take_back(ledger, group, reason)
    ledger.asks.pop(instance_id, None)
    return groups


def release_lost_holder(
    ledger: WorkLedger, instance_id: str, reason: str, max_losses: int = 0
) -> tuple[list[str], list[str]]:
    """Take back every open lease of instance_id, which recovery found lost (died or hung):
    (requeued, dropped). Each group counts the loss; one that has now lost `max_losses`
    holders (0: no limit) is a poison group, one that takes down whatever generates it, and
    is dropped instead of being leased again. Since a group lost once is leased alone after
    that, only its first loss can be shared with the groups leased beside it. Mutates."""
    requeued, dropped = [], []
    for group in _leased_to(ledger, instance_id):
        losses = ledger.losses[group] = ledger.losses.get(group, 0) + 1
        if poison_group(losses, max_losses):
            del ledger.open[group]
            _drop(
                ledger,
                group,
                f"poison group: lost {losses} holders while out to them, the last one {reason}",
            )
            ledger.poisoned += 1
            dropped.append(group)
        else:
            take_back(ledger, group, reason)
            requeued.append(group)
    ledger.asks.pop(instance_id, None)
    return requeued, dropped


def expire(ledger: WorkLedger, now: float) -> list[str]:
    """Requeue leases past their deadline. Mutates."""
    late = [g for g, held in ledger.open.items() if held.deadline < now]
    for group in late:
        take_back(ledger, group, f"lease of {ledger.open[group].instance_id} expired")
    return late


def _outstanding(ledger: WorkLedger, group: str) -> bool:
    """Leased and not settled yet: out to a holder, delivered, or waiting to be leased again."""
    return group in ledger.open or group in ledger.delivered or group in ledger.requeued


def _was_trained(ledger: WorkLedger, group: str, paged_out: Container[str]) -> bool:
    """Leased once (below the cursor, this job's id) and settled as trained: not dropped,
    whether the ledger still lists the drop or a page (`paged_out`) does."""
    parsed = parse_group_id(group)
    return (
        parsed is not None
        and parsed[0] == ledger.job_id
        and parsed[1] < ledger.next_index
        and not _outstanding(ledger, group)
        and group not in ledger.discarded
        and group not in paged_out
    )


def trained_unless_paged(ledger: WorkLedger, groups: Iterable[str]) -> list[str]:
    """Those of `groups` that `regenerate` takes for trained unless a page lists them as
    dropped: the only ids worth looking up in the pages."""
    return [g for g in groups if _was_trained(ledger, g, ())]


def record_progress(
    ledger: WorkLedger,
    trained: list[str],
    discarded: dict[str, str],
    paged_out: Container[str] = (),
    *,
    step: int = 0,
    durable: int = 0,
    restored: int = 0,
) -> list[str]:
    """The trainer trained or dropped these groups: they are settled for good. Mutates.

    Only outstanding groups settle, so `trained` counts each training once: a report sent
    again, or a group listed twice, changes nothing the second time. One exception: a group
    counted as trained that the trainer now drops was trained by a step a restore took back
    (a trainer never takes in a group it has trained), and the restored trainer dropped it
    (too stale by then): it moves from trained to dropped, so the ledger matches what the
    model was trained on. `paged_out`: those of `discarded` that a page lists as dropped
    already (see `regenerate`). Returns the ids ignored.

    `step`: the report's step (the one that trained `trained`); `durable`: steps below it are
    in the reporting trainer's durable checkpoint; `restored`: the step it restored from.
    Groups that an earlier trainer trained by a step after `restored` were trained by a step
    lost with it: they are delivered again (their rollout re-sends them, or `release_lost`
    takes them back) before this report's groups settle.
    """
    for group, held in ledger.held.items():
        if held.intake < ledger.intake and held.step > restored:
            held.step = 0
            ledger.trained -= 1
            ledger.delivered.append(group)
    ignored = []
    for group, why in [*((g, None) for g in trained), *discarded.items()]:
        if why is not None and _was_trained(ledger, group, paged_out):
            ledger.trained -= 1
            _drop(ledger, group, why)
            continue
        if not _outstanding(ledger, group):
            ignored.append(group)
            continue
        lease = ledger.open.pop(group, None)
        if group in ledger.delivered:
            ledger.delivered.remove(group)
        if group in ledger.requeued:
            ledger.requeued.remove(group)
        if why is None:
            ledger.trained += 1
            ledger.losses.pop(group, None)
            # Trained before its CompleteWork arrived: its lease names who sent it. Taken back
            # meanwhile: nobody known ("" is never alive), so it is generated again if lost.
            was = ledger.held.pop(group, None)
            holder = was.holder if was else lease.instance_id if lease else ""
            if step > 0:
                ledger.held[group] = Holding(holder=holder, intake=ledger.intake, step=step)
        else:
            _drop(ledger, group, why)
    for group in [
        g
        for g, held in ledger.held.items()
        if 0 < held.step <= (durable if held.intake == ledger.intake else restored)
    ]:
        del ledger.held[group]  # in a durable checkpoint: trained for good
    return ignored


def trainer_replaced(ledger: WorkLedger) -> None:
    """The trainer is being replaced: its intake (what was delivered to it) is lost, and so are
    the steps after its last durable checkpoint (see `record_progress`). Mutates."""
    ledger.intake += 1


def release_lost(ledger: WorkLedger, alive: Container[str]) -> list[str]:
    """Take back delivered groups held by nobody: delivered to a trainer since replaced, by a
    rollout that is not `alive` (so it cannot re-send them). Returns them. Mutates."""
    lost = [
        (group, held.holder)
        for group, held in ledger.held.items()
        if held.step == 0 and held.intake < ledger.intake and held.holder not in alive
    ]
    for group, holder in lost:
        take_back(ledger, group, f"held by {holder}, gone, for a trainer since replaced")
    return [group for group, _ in lost]


def regenerate(
    ledger: WorkLedger, groups: dict[str, str], paged_out: Container[str] = ()
) -> list[str]:
    """The trainer refused these groups (made with weights lost when it was restored): lease
    them again, whatever the ledger says of them (delivered, or trained by a step the restore
    took back: that training no longer counts). Groups dropped for good, already waiting or
    out to be generated again, or never leased, are left. `paged_out`: those of `groups` that
    a page lists as dropped (the caller reads them when `ledger.pages`). Returns the groups
    requeued. Mutates."""
    requeued = []
    for group, why in groups.items():
        if _was_trained(ledger, group, paged_out):
            ledger.trained -= 1
        elif group not in ledger.delivered:
            continue  # dropped, waiting, out, or an id this ledger never leased
        take_back(ledger, group, f"the trainer needs it generated again: {why}")
        requeued.append(group)
    return requeued


def settle_leftovers(ledger: WorkLedger, reason: str) -> list[str]:
    """The job ended: every group still open, requeued or delivered is dropped, with why."""
    left = [*ledger.open, *ledger.requeued, *ledger.delivered]
    for group in left:
        _drop(ledger, group, reason)
    ledger.open.clear()
    ledger.requeued.clear()
    ledger.delivered.clear()
    ledger.held.clear()  # no trainer will be replaced for this job any more
    return left
