"""Group commit of one record (services.coordinator.coalesce), with a write that takes time."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.coalesce import CoalescedWrites


class Record:
    """A value many callers change, and what each write stored of it."""

    def __init__(self, fail_writes: int = 0) -> None:
        self.value: list[int] = []
        self.stored: list[list[int]] = []
        self.fail_writes = fail_writes
        self.gate = asyncio.Semaphore(0)
        """One release lets one write land."""

    async def write(self) -> None:
        snapshot = list(self.value)  # read before the first await, as the ledger's write does
        await self.gate.acquire()
        if self.fail_writes:
            self.fail_writes -= 1
            raise RuntimeError("etcd refused")
        self.stored.append(snapshot)


async def test_changes_made_while_a_write_is_in_flight_share_the_next_write() -> None:
    record = Record()
    writes = CoalescedWrites(record.write)
    record.value.append(0)
    first = writes.changed()
    await asyncio.sleep(0)  # the first write has begun, with [0]
    waiting = []
    for n in range(1, 20):
        record.value.append(n)
        waiting.append(writes.changed())
    assert not first.done()
    record.gate.release()
    record.gate.release()
    await asyncio.wait_for(asyncio.gather(first, *waiting), 5)
    # Two writes for twenty changes, and the last carries all of them.
    assert record.stored == [[0], list(range(20))]
    assert writes.writes == 2


async def change_twice_then_let_one_write_land(
    record: Record,
) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
    """Change 1, its write begins; change 2 meanwhile; the first write may land."""
    writes = CoalescedWrites(record.write)
    record.value.append(1)
    first = writes.changed()
    await asyncio.sleep(0)
    record.value.append(2)
    second = writes.changed()
    record.gate.release()
    return first, second


async def test_no_caller_hears_its_change_stored_before_a_write_that_carries_it_lands() -> None:
    record = Record()
    first, second = await change_twice_then_let_one_write_land(record)
    await first
    # The first write landed without 2: its caller is still waiting.
    assert record.stored == [[1]] and not second.done()
    record.gate.release()
    await asyncio.wait_for(second, 5)
    assert record.stored == [[1], [1, 2]]


async def test_a_failed_write_fails_its_callers_and_later_changes_are_written_again() -> None:
    record = Record(fail_writes=1)
    first, second = await change_twice_then_let_one_write_land(record)
    with pytest.raises(RuntimeError, match="etcd refused"):
        await first
    assert not second.done()
    record.gate.release()
    await asyncio.wait_for(second, 5)
    assert record.stored == [[1, 2]]  # the retry carries the failed change too


async def test_stop_cancels_the_write_in_flight_and_its_callers() -> None:
    record = Record()
    writes = CoalescedWrites(record.write)
    record.value.append(1)
    first = writes.changed()
    await asyncio.sleep(0)
    await writes.stop()
    assert first.cancelled() and record.stored == []
