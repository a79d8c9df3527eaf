"""The leader gets a real etcd out of NOSPACE (coordinator/space.py): an etcd with a 1 MiB
quota, filled by rewriting one key (history, which compaction frees) or by many keys (live
data, which it does not)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aetcd
import grpc
import pytest

from robustrl.contracts import packed
from robustrl.core.aio import cancel_and_wait
from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import coordinator_pb2 as pb
from robustrl.v1 import coordinator_pb2_grpc
from services.coordinator import work
from services.coordinator.jobs import Phase, new_job, transition
from services.coordinator.space import SpaceKeeper, nospace_members
from tests.support import eventually
from tests.support.cluster import (
    SPEC,
    EtcdMember,
    accepts_writes,
    fill_etcd,
    leader_of,
    lone_leader,
    small_etcds,
    start_coordinators,
    started_member,
    stored_member,
)

PREFIX = "/robustrl-space"


async def test_the_leader_frees_an_etcd_whose_history_filled_its_quota(small_etcd: str) -> None:
    """A job's etcd filled by rewrites (as the ledger is rewritten) stops taking writes; the
    leader's next round compacts, defragments and disarms, and the job's writes land again."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    async with lone_leader(settings, "space") as (runtime, leadership, driver):
        assert runtime.client is not None
        client = runtime.client
        driver.supervisor.space = SpaceKeeper(lambda: runtime.client, settings, check_every=0)
        record = transition(new_job("sp", {"name": "sp"}, 0.0), Phase.RUNNING, "x", now=0.0)
        await driver.store.create(record, leadership.guard())
        ledger = driver.ledgers["sp"] = work.WorkLedger(job_id="sp")
        assert await fill_etcd(client, PREFIX, one_key=True) > 5
        assert await nospace_members(client)
        with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
            await driver.save_ledger(ledger)

        await driver.tick()

        assert not await nospace_members(client) and driver.supervisor.space.recoveries == 1
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
        await fill_etcd(client, PREFIX, one_key=False)
        first = await keeper.keep()
        assert first is not None and not await nospace_members(client)
        assert first.db_bytes_after > first.db_bytes_before // 2  # live data: little freed

        gaps = []
        for _ in range(3):
            await fill_etcd(client, PREFIX, one_key=False)
            now[0] += 10
            assert await keeper.keep() is None and await nospace_members(client)  # waits its gap
            now[0] += keeper.gap
            assert await keeper.keep() is not None and not await nospace_members(client)
            gaps.append(keeper.gap)
        assert gaps == [120, 240, 480]

        await fill_etcd(client, PREFIX, one_key=False)
        now[0] += 10_000  # a quiet spell: the next alarm is met at once, and the gap resets
        assert await keeper.keep() is not None and keeper.gap == 60
        assert keeper.recoveries == 5
    finally:
        await client.close()


@pytest.mark.parametrize("recovery", [True, False])
async def test_coordinator_replicas_answer_unavailable_under_nospace_until_the_leader_frees_it(
    small_etcd: str, recovery: bool
) -> None:
    """Real replicas (coordinator.server). While etcd refuses writes, a write to the leader is
    UNAVAILABLE, which every client rides out (it used to be UNKNOWN, and a trainer whose
    report met it stopped on an error); with `etcd_space_recovery` (the default) the leader
    frees etcd and the write goes through; with it off, the alarm stays for a person."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    runtimes = await start_coordinators(settings, etcd_space_recovery=recovery)
    client = aetcd.Client(*settings.endpoint_list()[0])
    channel = grpc.aio.insecure_channel(runtimes[0].address)
    api = coordinator_pb2_grpc.CoordinatorStub(channel)
    try:
        await client.create_alarm()  # as a full quota raises it

        async def submitted() -> bool:
            try:
                await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC), timeout=5)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
                assert "out of space" in (exc.details() or "")
                return False
            return True

        if recovery:
            await eventually(submitted, timeout=15)
            assert not await nospace_members(client)
        else:
            for _ in range(3):
                assert not await submitted()
            assert await nospace_members(client)
    finally:
        await channel.close()
        await client.close()
        for runtime in runtimes:
            await runtime.shutdown()


@pytest.fixture
def small_cluster(tmp_path: Path) -> Iterator[list[EtcdMember]]:
    with small_etcds(tmp_path, 3) as members:
        yield members


async def test_every_member_of_a_cluster_is_defragmented_and_disarmed(
    small_cluster: list[EtcdMember],
) -> None:
    """A three-member cluster filled by rewrites: a member that reaches its quota raises
    NOSPACE under its own id (which members do, and when, varies: the test raises it for the
    others too). Given one endpoint only (as behind a service name), the keeper reaches every
    member at the address it advertises, shrinks each file, and disarms every alarm.

    One follower lags: it is paused (SIGSTOP) as the history is compacted, for a second, so it
    applies the compaction late. Each member deletes the compacted history on its own time, and
    a member defragmented before that keeps its whole file: the keeper waits for it."""
    settings = EtcdSettings(endpoints=small_cluster[0].endpoint, prefix=PREFIX)
    client = aetcd.Client(*settings.endpoint_list()[0])
    try:
        await fill_etcd(client, PREFIX, one_key=True)
        async for member in client.members():
            await client.create_alarm(member.id)
        assert len(await nospace_members(client)) == 3
        leader_urls = (await client.status()).leader.client_urls
        lagging = next(m for m in small_cluster[1:] if f"http://{m.endpoint}" not in leader_urls)
        compact = client.compact

        async def compact_while_one_lags(revision: int, physical: bool = False) -> None:
            os.kill(lagging.pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(1.0, os.kill, lagging.pid, signal.SIGCONT)
            client.compact = compact  # once
            await compact(revision, physical=physical)

        client.compact = compact_while_one_lags

        recovery = await SpaceKeeper(lambda: client, settings, check_every=0).keep()

        assert recovery is not None and not await nospace_members(client)
        for member in small_cluster:
            endpoint = EtcdSettings(endpoints=member.endpoint).endpoint_list()[0]
            async with aetcd.Client(*endpoint) as one:
                assert (await one.status()).db_size < recovery.db_bytes_before // 4, member
        await client.put(f"{PREFIX}/after".encode(), b"taken")
    finally:
        await client.close()


async def test_services_started_under_nospace_wait_and_a_coordinator_frees_it(
    small_etcd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No coordinator runs while etcd is out of space (all restarted at once, say), and etcd
    grants no lease then, so no replica could register or campaign: each used to exit at
    start, for good. Now a member started then waits instead of failing, and a coordinator
    replica started then frees etcd itself, registers, leads, and the waiting member
    registers too."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    client = aetcd.Client(*settings.endpoint_list()[0])
    member: asyncio.Task[ServiceRuntime] | None = None
    runtimes: list[ServiceRuntime] = []
    try:
        await fill_etcd(client, PREFIX, one_key=True)
        assert await nospace_members(client)
        tries = 0
        open_session = ServiceRuntime._open_session

        async def counted(runtime: ServiceRuntime) -> None:
            nonlocal tries
            tries += 1
            await open_session(runtime)

        monkeypatch.setattr(ServiceRuntime, "_open_session", counted)
        member = asyncio.create_task(started_member("rollout", "rollout-waits", settings))

        async def refused_and_trying_again() -> bool:  # four refusals: some 3 s of backing off
            return tries >= 5 or member.done()

        await eventually(refused_and_trying_again, timeout=20)
        assert not member.done()  # waiting, not failed
        assert await nospace_members(client)  # members do not free etcd themselves

        runtimes = await start_coordinators(settings)

        assert not await nospace_members(client)
        runtimes.append(await asyncio.wait_for(member, 15))
        assert await stored_member(client, settings, "rollout", "rollout-waits") is not None
    finally:
        if member is not None and not member.done():
            await cancel_and_wait(member)
        for runtime in runtimes:
            await runtime.shutdown()
        await client.close()


async def test_replicas_that_all_lost_their_sessions_under_nospace_free_it_and_one_leads(
    small_etcd: str,
) -> None:
    """Real replicas; etcd fills, and both lose their sessions (their leases revoked, as an
    expiry does). None leads, so no supervision round frees etcd, and etcd grants the new
    lease that re-registering and campaigning need to nobody: the replicas free it as they try
    to register again, and one leads and takes writes. (Rounds a minute apart keep the leader
    from freeing etcd in the moment before it learns that its session is gone.)"""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    runtimes = await start_coordinators(settings, tick_interval=60.0)
    client = aetcd.Client(*settings.endpoint_list()[0])
    try:
        await fill_etcd(client, PREFIX, one_key=True)
        for runtime in runtimes:
            assert runtime.session is not None
            await client.revoke_lease(runtime.session.lease_id)

        async def led() -> bool:
            leader = await leader_of(runtimes)
            return leader is not None and await accepts_writes(leader)

        await eventually(led, timeout=20)
        assert not await nospace_members(client)
    finally:
        await client.close()
        for runtime in runtimes:
            await runtime.shutdown()


async def test_a_lease_that_could_not_be_stored_goes_back_to_the_front_of_the_queue(
    small_etcd: str,
) -> None:
    """A real leader and a bound rollout: while etcd is out of space, every lease the rollout
    asks for fails, and its groups go back to the queue (they used to stay leased to it in the
    leader's memory, for nobody, until their lease ran out, and repeated asks filled the job's
    budget). Once etcd is freed, the next ask gets the same groups first, and they are stored."""
    settings = EtcdSettings(endpoints=small_etcd, prefix=PREFIX)
    async with lone_leader(settings, "unlease") as (runtime, leadership, driver):
        assert runtime.client is not None
        client = runtime.client
        record = transition(new_job("ul", {"name": "arith"}, 0.0), Phase.RUNNING, "x", now=0.0)
        await driver.store.create(record, leadership.guard())
        driver.ledgers["ul"] = work.WorkLedger(job_id="ul")
        rollout = await started_member("rollout", "r1", settings)
        try:
            await rollout.update_member(job_id="ul")
            request = pb.LeaseWorkRequest(job_id="ul", instance_id="r1", epoch=1, max_groups=4)
            first = [work.group_id("ul", i) for i in range(4)]
            await fill_etcd(client, PREFIX, one_key=True)
            for _ in range(3):
                with pytest.raises(aetcd.exceptions.ClientError, match="space exceeded"):
                    await driver.work.lease_work(request)
                ledger = driver.accounting.ledger("ul")
                assert ledger.open == {} and ledger.requeued == first
                assert ledger.taken_back == 0

            await SpaceKeeper(lambda: runtime.client, settings, check_every=0).keep()
            reply = await driver.work.lease_work(request)

            assert [g.group_id for g in reply.groups] == first
            stored = await client.get(runtime.keys.work("ul"))
            assert stored is not None
            assert set(packed.load(work.WorkLedger, stored.value).open) == set(first)
        finally:
            await rollout.shutdown()
