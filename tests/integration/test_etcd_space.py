"""The leader gets a real etcd out of NOSPACE (coordinator/space.py): an etcd with a 1 MiB
quota, filled by rewriting one key (history, which compaction frees) or by many keys (live
data, which it does not)."""

from __future__ import annotations

import os

import aetcd
import pytest
from aetcd import rpc

from services.common.config import EtcdSettings
from services.coordinator import work
from services.coordinator.jobs import Phase, new_job, transition
from services.coordinator.space import SpaceKeeper
from tests.integration.test_coordinator import lone_leader

PREFIX = "/robustrl-space"
CHUNK = 100_000


async def fill(client: aetcd.Client, *, one_key: bool) -> int:
    """Put 100 KB values until etcd refuses with NOSPACE; how many landed."""
    landed = 0
    with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
        while landed < 1000:
            key = f"{PREFIX}/fill/{0 if one_key else landed}".encode()
            await client.put(key, os.urandom(CHUNK))
            landed += 1
    return landed


async def nospace(client: aetcd.Client) -> bool:
    return bool([a async for a in client.list_alarms() if a.alarm_type == rpc.NOSPACE])


async def test_the_leader_frees_an_etcd_whose_history_filled_its_quota(small_etcd: str) -> None:
    """A job's etcd filled by rewrites (as the ledger is rewritten) stops taking writes; the
    leader's next round compacts, defragments and disarms, and the job's writes land again."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    async with lone_leader(settings, "space") as (runtime, leadership, driver):
        assert runtime.client is not None
        client = runtime.client
        driver.space = SpaceKeeper(lambda: runtime.client, settings, check_every=0)
        record = transition(new_job("sp", {"name": "sp"}, 0.0), Phase.RUNNING, "x", now=0.0)
        await driver.store.create(record, leadership.guard())
        ledger = driver.ledgers["sp"] = work.WorkLedger(job_id="sp")
        assert await fill(client, one_key=True) > 5
        assert await nospace(client)
        with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
            await driver.save_ledger(ledger)

        await driver.tick()

        assert not await nospace(client) and driver.space.recoveries == 1
        await driver.save_ledger(ledger)
        await driver.update_job("sp", {"step": 3}, Phase.RUNNING, "running")
        assert (await driver.store.get("sp"))[0].step == 3
        assert (await client.status()).db_size < 1 << 20


async def test_a_quota_full_of_live_data_is_freed_ever_less_often(small_etcd: str) -> None:
    """Live data over the quota: each recovery gives a write or so before NOSPACE is back. The
    keeper waits its gap before the next try (no defragment loop), doubles the gap each time
    the alarm returns within twice of it, and starts over from the shortest after a quiet
    spell. A clock of the test's own stands for the minutes."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    now = [1000.0]
    client = aetcd.Client(*settings.endpoint_list()[0])
    keeper = SpaceKeeper(lambda: client, settings, check_every=0, min_gap=60, clock=lambda: now[0])
    try:
        assert await keeper.keep() is None  # healthy: nothing to do
        await fill(client, one_key=False)
        first = await keeper.keep()
        assert first is not None and not await nospace(client)
        assert first.db_bytes_after > first.db_bytes_before // 2  # live data: little freed

        gaps = []
        for _ in range(3):
            await fill(client, one_key=False)
            now[0] += 10
            assert await keeper.keep() is None and await nospace(client)  # waits its gap
            now[0] += keeper.gap
            assert await keeper.keep() is not None and not await nospace(client)
            gaps.append(keeper.gap)
        assert gaps == [120, 240, 480]

        await fill(client, one_key=False)
        now[0] += 10_000  # a quiet spell: the next alarm is met at once, and the gap resets
        assert await keeper.keep() is not None and keeper.gap == 60
        assert keeper.recoveries == 5
    finally:
        await client.close()
