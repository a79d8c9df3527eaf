"""The coordinator's work ledger: leasing, backpressure, take-backs and settlement."""

from __future__ import annotations

from services.coordinator import work


def ledger() -> work.WorkLedger:
    return work.WorkLedger(job_id="j")


def lease(
    led: work.WorkLedger, who: str, n: int, *, budget: int = 8, now: float = 0.0
) -> list[str]:
    return work.lease(
        led, instance_id=who, epoch=1, max_groups=n, budget=budget, now=now, lease_seconds=10.0
    )


def test_leases_walk_the_dataset_and_respect_the_budget() -> None:
    led = ledger()
    assert lease(led, "r0", 3) == ["j-g000000", "j-g000001", "j-g000002"]
    assert lease(led, "r1", 10, budget=5) == ["j-g000003", "j-g000004"]
    assert lease(led, "r1", 1, budget=5) == []  # 5 outstanding: nothing more until trained
    work.complete(led, "r0", ["j-g000000"])
    assert lease(led, "r1", 1, budget=5) == []  # delivered but untrained still counts
    work.record_progress(led, ["j-g000000"], {})
    assert lease(led, "r1", 1, budget=5) == ["j-g000005"]


def test_a_dead_holders_groups_are_leased_again_first_with_the_same_ids() -> None:
    led = ledger()
    mine = lease(led, "r0", 2)
    lease(led, "r1", 1)
    assert work.release_holder(led, "r0", "r0 left the registry") == mine
    assert lease(led, "r1", 3) == [*mine, "j-g000003"]
    assert led.released == {g: ["r0 left the registry"] for g in mine}
    assert not led.losses  # it may only have let its session lapse: not a loss


def test_an_undone_lease_frees_the_budget_and_comes_back_first_uncounted() -> None:
    led = ledger()
    requeued = lease(led, "r0", 1)
    work.release_holder(led, "r0", "left")
    mine = lease(led, "r1", 3, budget=3)
    assert lease(led, "r2", 1, budget=3) == []
    assert work.unlease(led, "r1", [*mine, "j-g000009"]) == mine  # one it never held
    assert led.open == {} and led.requeued == mine and mine[0] == requeued[0]
    assert led.taken_back == 1 and list(led.released) == requeued  # the undo counts nothing
    assert lease(led, "r2", 3, budget=3) == mine
    assert work.unlease(led, "r1", mine) == []  # now another's: left alone
    assert set(led.open) == set(mine)


def test_the_groups_of_a_lost_holder_come_back_first_and_each_alone() -> None:
    led = ledger()
    mine = lease(led, "r0", 2)
    lease(led, "r1", 1)
    assert work.release_lost_holder(led, "r0", "r0 died") == (mine, [])
    assert lease(led, "r1", 3) == [mine[0]]
    assert lease(led, "r1", 3) == [mine[1]]
    assert lease(led, "r1", 3) == ["j-g000003", "j-g000004", "j-g000005"]


def test_a_group_that_takes_down_every_holder_is_dropped_and_only_it() -> None:
    led = ledger()
    poison, beside = lease(led, "r0", 2)
    assert work.release_lost_holder(led, "r0", "r0 died", 3) == ([poison, beside], [])
    for lost, who in ((2, "r1"), (3, "r2")):
        assert lease(led, who, 4) == [poison]  # alone, so its losses are its own
        if lost == 2:
            assert lease(led, "r9", 4)[0] == beside  # ... and the innocent one goes out alone
            work.complete(led, "r9", [beside])
            work.record_progress(led, [beside], {})
            assert beside not in led.losses  # settled: its loss is forgotten
        requeued, dropped = work.release_lost_holder(led, who, f"{who} hung", 3)
    assert (requeued, dropped) == ([], [poison])
    assert led.discarded[poison].startswith("poison group: lost 3 holders")
    assert "r2 hung" in led.discarded[poison]
    assert poison not in led.open and poison not in led.requeued and not led.losses
    assert led.poisoned == 1
    assert led.trained == 1 and led.dropped == 1


def test_without_a_loss_limit_a_group_is_never_dropped() -> None:
    led = ledger()
    [group] = lease(led, "r0", 1)
    for n in range(10):
        assert work.release_lost_holder(led, f"r{n}", "lost") == ([group], [])
        assert lease(led, f"r{n + 1}", 1) == [group]
    assert led.losses == {group: 10} and not led.discarded


def test_late_leases_expire() -> None:
    led = ledger()
    groups = lease(led, "r0", 2, now=0.0)
    assert work.expire(led, now=5.0) == []
    assert work.expire(led, now=11.0) == groups
    assert led.requeued == groups and not led.open


def test_a_completion_from_someone_who_no_longer_holds_the_lease_is_ignored() -> None:
    led = ledger()
    [group] = lease(led, "r0", 1)
    work.release_holder(led, "r0", "fenced")
    lease(led, "r1", 1)
    assert work.complete(led, "r0", [group]) == [group]  # the zombie changes nothing
    assert led.open[group].instance_id == "r1"
    assert work.complete(led, "r1", [group]) == []
    assert led.delivered == [group]


def test_settled_groups_leave_every_other_state() -> None:
    led = ledger()
    a, b, c = lease(led, "r0", 3)
    work.complete(led, "r0", [a, b])
    # The trainer may settle a group before its rollout reported completion.
    work.record_progress(led, [a, c], {b: "stale"})
    assert led.trained == 2 and led.discarded == {b: "stale"}
    assert not led.open and not led.delivered
    assert work.complete(led, "r0", [c]) == [c]  # a late completion of a trained group: ignored
    assert not led.delivered


def test_a_finished_job_accounts_for_every_group_it_leased() -> None:
    led = ledger()
    a, b, c = lease(led, "r0", 3)
    work.complete(led, "r0", [a])
    work.release_holder(led, "r0", "lost")
    work.record_progress(led, [a], {}, step=3, durable=2)  # step 3 not durable yet
    assert set(work.settle_leftovers(led, "job succeeded first")) == {b, c}
    assert led.next_index == led.trained + len(led.discarded)
    assert led.held == {}


def test_groups_given_back_unfinished_are_leased_again_at_once() -> None:
    led = ledger()
    mine = lease(led, "r0", 2)
    assert work.give_back(led, "r0", {mine[0]: "non-finite logprobs", "j-g000099": "x"}) == [
        "j-g000099"
    ]
    assert work.give_back(led, "r1", {mine[1]: "not mine"}) == [mine[1]]
    assert lease(led, "r1", 1) == [mine[0]]
    assert led.released[mine[0]] == ["r0 gave it back: non-finite logprobs"]


def test_groups_the_restored_trainer_refused_are_leased_again_and_free_the_budget() -> None:
    led = ledger()
    delivered = lease(led, "r0", 4, budget=4)
    work.complete(led, "r0", delivered)
    work.record_progress(led, [delivered[0]], {})  # trained by a step the restore took back
    assert lease(led, "r1", 1, budget=4) == ["j-g000004"]  # still open below
    work.record_progress(led, [], {delivered[3]: "stale"})  # dropped for good
    lost = "made with weight version 9, lost"

    again = work.regenerate(led, {g: lost for g in (*delivered, "j-g000004")})

    # Delivered or trained-then-lost groups come back; dropped and still-open ones do not.
    assert again == delivered[:3]
    assert led.delivered == [] and led.requeued == delivered[:3]
    assert lease(led, "r1", 8, budget=4) == delivered[:3]
    assert led.released[delivered[1]] == [f"the trainer needs it generated again: {lost}"]


def test_each_group_is_counted_trained_once_however_often_it_is_reported() -> None:
    led = ledger()
    a, b = lease(led, "r0", 2)
    work.complete(led, "r0", [a, b])
    assert work.record_progress(led, [a, a], {}) == [a]  # listed twice in one report
    assert work.record_progress(led, [a, b], {}) == [a]  # the report sent again
    assert work.record_progress(led, ["j-g000099", "other-g000000"], {"j-g000098": "x"}) == [
        "j-g000099",
        "other-g000000",
        "j-g000098",
    ]  # never leased: nothing settles
    assert led.trained == 2 and led.discarded == {}


def test_a_group_trained_by_a_step_the_restore_took_back_and_then_dropped_counts_as_dropped() -> (
    None
):
    # The trainer trained a and b in step s and reported it, then died before step s's
    # checkpoint; the restored trainer got a and b again, trained b and found a too stale.
    led = ledger()
    a, b = lease(led, "r0", 2)
    work.complete(led, "r0", [a, b])
    assert work.record_progress(led, [a, b], {}) == []
    why = "stale: generated with weight version 52, too old for step 54 (bound 1)"

    assert work.record_progress(led, [b], {a: why}) == [b]  # b: counted once

    assert led.trained == 1 and led.discarded == {a: why} and led.dropped == 1
    assert work.record_progress(led, [], {a: why}) == [a]  # the report sent again
    assert led.trained == 1 and led.dropped == 1
    assert led.next_index == led.trained + led.dropped


def test_a_drop_reported_again_after_its_page_moved_out_is_not_counted_twice() -> None:
    led = ledger()
    (a,) = lease(led, "r0", 1)
    work.complete(led, "r0", [a])
    work.record_progress(led, [], {a: "stale"})
    paged = work.page_out(led, page_size=1)
    assert paged is not None
    led, _ = paged

    assert work.record_progress(led, [], {a: "stale"}, paged_out={a}) == [a]

    assert led.trained == 0 and led.dropped == 1


def test_a_training_the_restore_took_back_stops_counting_until_the_group_trains_again() -> None:
    led = ledger()
    a, b, c = lease(led, "r0", 3)
    work.complete(led, "r0", [a, b, c])
    work.record_progress(led, [a, b], {c: "stale"})
    lost = "made with weight version 3, lost"

    again = work.regenerate(led, {a: lost, c: lost, "j-g000007": lost, "x-g000000": lost})

    assert again == [a]  # c was dropped for good; the other two were never leased
    assert led.trained == 1 and led.requeued == [a]
    assert lease(led, "r1", 1) == [a]
    work.complete(led, "r1", [a])
    work.record_progress(led, [a], {})
    assert led.trained == 2
    work.settle_leftovers(led, "job succeeded first")
    assert led.next_index == led.trained + len(led.discarded)


def test_dropped_groups_and_take_backs_move_to_pages_and_none_is_lost() -> None:
    led = ledger()
    pages: list[work.DroppedPage] = []
    groups = lease(led, "r0", 20, budget=20)
    work.release_holder(led, "r0", "r0 left the registry")  # 20 take-backs
    groups = lease(led, "r1", 20, budget=20)
    work.complete(led, "r1", groups)
    for i, group in enumerate(groups):
        if i % 3:
            work.record_progress(led, [group], {})
        else:
            work.record_progress(led, [], {group: f"stale {i}"})
        paged = work.page_out(led, page_size=4)
        if paged:
            assert paged[0].pages == led.pages + 1 and paged[0].discarded == {}
            assert led.discarded or led.released  # the ledger itself is left as it was
            led, page = paged
            pages.append(page)

    assert len(pages) == 2 and led.pages == 2
    assert len(led.discarded) + len(led.released) < 4
    dropped = {g: why for page in pages for g, why in page.discarded.items()} | led.discarded
    assert dropped == {g: f"stale {i}" for i, g in enumerate(groups) if i % 3 == 0}
    assert led.dropped == len(dropped) == 7 and led.trained == 13
    assert led.taken_back == 20 == sum(len(p.released[g]) for p in pages for g in p.released)
    assert led.next_index == led.trained + led.dropped


def test_a_dropped_group_on_a_page_is_not_taken_for_trained() -> None:
    led = ledger()
    a, b = lease(led, "r0", 2)
    work.complete(led, "r0", [a, b])
    work.record_progress(led, [a], {b: "stale"})
    paged = work.page_out(led, page_size=1)
    assert paged is not None
    led, page = paged
    assert led.discarded == {} and page.discarded == {b: "stale"}
    lost = "made with weight version 3, lost"

    assert work.regenerate(led, {a: lost, b: lost}, paged_out={b}) == [a]

    assert led.trained == 0 and led.requeued == [a] and led.dropped == 1


def test_groups_held_only_by_a_rollout_that_died_with_the_trainer_are_leased_again() -> None:
    # r1 delivered four groups; step 5 trained two of them, and only steps below 4 are in a
    # durable checkpoint. Then the trainer and r1 died together (one machine).
    led = ledger()
    groups = lease(led, "r1", 4)
    work.complete(led, "r1", groups)
    work.record_progress(led, groups[:2], {}, step=5, durable=4)
    assert led.trained == 2
    work.trainer_replaced(led)

    # What only reached the lost intake comes back at once; the trained two wait for the new
    # trainer to say which steps it restored.
    assert work.release_lost(led, alive={"r0"}) == groups[2:]
    assert work.release_lost(led, alive={"r0"}) == []
    work.record_progress(led, [], {}, step=4, durable=4, restored=4)  # step 5 was lost

    assert work.release_lost(led, alive={"r0"}) == groups[:2]
    assert led.trained == 0 and led.requeued == [*groups[2:], *groups[:2]]
    assert lease(led, "r0", 4) == [*groups[2:], *groups[:2]]  # the same ids, first
    work.complete(led, "r0", groups)
    work.record_progress(led, groups, {}, step=6, durable=4, restored=4)
    work.record_progress(led, [], {}, step=6, durable=6, restored=4)
    assert led.trained == 4 and led.held == {}


def test_groups_whose_rollout_lives_wait_for_its_resend_to_the_new_trainer() -> None:
    led = ledger()
    groups = lease(led, "r1", 3)
    work.complete(led, "r1", groups)
    work.record_progress(led, groups[:2], {}, step=5, durable=4)
    work.trainer_replaced(led)
    work.record_progress(led, [], {}, step=4, durable=4, restored=4)
    assert led.trained == 0 and sorted(led.delivered) == sorted(groups)
    assert work.release_lost(led, alive={"r1"}) == []  # r1 re-sends them

    # The new trainer trains them, and its first report already finds step 5 durable: that
    # is its own step 5, not the lost one.
    work.record_progress(led, groups, {}, step=5, durable=5, restored=4)

    assert led.trained == 3 and led.delivered == []
    assert led.held == {}
    assert work.release_lost(led, alive=set()) == []


def test_a_durable_step_keeps_its_groups_trained_through_a_replacement() -> None:
    led = ledger()
    groups = lease(led, "r1", 2)
    work.complete(led, "r1", groups)
    work.record_progress(led, groups, {}, step=5, durable=5)  # durable before the report
    assert led.held == {}
    work.trainer_replaced(led)
    work.record_progress(led, [], {}, step=5, durable=5, restored=5)
    assert work.release_lost(led, alive=set()) == []
    assert led.trained == 2 and led.delivered == []


def test_a_dead_rollouts_deliveries_stay_while_the_trainer_that_has_them_lives() -> None:
    led = ledger()
    groups = lease(led, "r1", 2)
    work.complete(led, "r1", groups)
    assert work.release_lost(led, alive=set()) == []
    assert led.delivered == groups


def test_a_group_trained_before_its_completion_is_held_by_its_lease_holder() -> None:
    led = ledger()
    (a,) = lease(led, "r1", 1)
    work.record_progress(led, [a], {}, step=3, durable=2)  # CompleteWork not in yet
    assert led.held[a].holder == "r1" and led.held[a].step == 3
    assert work.complete(led, "r1", [a]) == [a]  # settled already: ignored
    work.trainer_replaced(led)
    work.record_progress(led, [], {}, step=2, durable=2, restored=2)
    assert work.release_lost(led, alive=set()) == [a]
    assert led.trained == 0


def test_a_new_trainers_own_durable_step_does_not_cover_the_lost_step_of_that_number() -> None:
    led = ledger()
    groups = lease(led, "r1", 2)
    work.complete(led, "r1", groups)
    work.record_progress(led, groups, {}, step=5, durable=4)
    work.trainer_replaced(led)

    # Its first report comes after its own step 5 is durable: the lost step 5 still counts
    # as lost, since the trainer restored step 4.
    work.record_progress(led, [], {}, step=5, durable=5, restored=4)

    assert led.trained == 0
    assert work.release_lost(led, alive=set()) == groups


def test_a_page_stored_while_more_groups_were_dropped_lets_go_only_of_what_it_holds() -> None:
    """The leader stores a page, and requests go on changing the ledger until the write lands:
    groups dropped or taken back meanwhile stay listed."""
    ledger = work.WorkLedger(job_id="fp")
    groups = work.lease(
        ledger, instance_id="r", epoch=1, max_groups=6, budget=6, now=0, lease_seconds=60
    )
    work.take_back(ledger, groups[0], "holder lost")
    work.give_back(ledger, "r", {groups[1]: "non-finite logprobs"})
    paged = work.page_out(ledger, page_size=2)
    assert paged is not None
    stored, page = paged
    # While the write is in flight: another take-back of a paged group, and a new drop.
    work.take_back(ledger, groups[0], "holder lost again")
    ledger.discarded[groups[5]] = "too stale"

    work.forget_paged(ledger, page, stored.pages)

    assert ledger.pages == 1
    assert ledger.released == {groups[0]: ["holder lost again"]}
    assert ledger.discarded == {groups[5]: "too stale"}
    assert page.released[groups[0]] == ["holder lost"]


def test_a_retried_ask_gets_what_it_already_got_and_nothing_more() -> None:
    led = ledger()

    def ask(request_id: str, n: int = 3, *, now: float = 0.0, epoch: int = 1) -> list[str]:
        return work.lease(
            led,
            instance_id="r0",
            epoch=epoch,
            max_groups=n,
            budget=8,
            now=now,
            lease_seconds=10.0,
            request_id=request_id,
        )

    first = ask("a")
    assert first == ["j-g000000", "j-g000001", "j-g000002"]
    assert ask("a", now=5.0) == first  # its answer was lost: the same groups, renewed
    assert {held.deadline for held in led.open.values()} == {15.0} and led.next_index == 3
    work.complete(led, "r0", first[:1])
    assert ask("a") == first[1:]  # what it delivered is not leased to it again
    assert ask("b", 1) == ["j-g000003"]  # a new ask: new work
    assert ask("b", 1, epoch=2) == ["j-g000004"]  # another epoch of r0: a new ask too
    assert ask("", 1) == ["j-g000005"] and ask("", 1) == ["j-g000006"]  # no id: each is new
    assert work.unlease(led, "r0", ["j-g000004"]) == ["j-g000004"]
    assert ask("b", 1, epoch=2) == ["j-g000004"]  # its store failed: asked again, leased anew
    work.release_holder(led, "r0", "left")
    assert "r0" not in led.asks
    assert ask("b", 1, epoch=2) == ["j-g000001"]  # what was taken back goes first, as new work
