"""Session, Registry, Election and the resumable watch against a real etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aetcd
import pytest

from robustrl.cli.stack import StackState, etcd_healthy, start_etcd, stop_procs, wait_until
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings
from robustrl.core.election import Election, current_leader
from robustrl.core.etcd_client import ETCD_UNREACHABLE, connect_etcd
from robustrl.core.registry import Registry
from robustrl.core.role_server import RoleControl
from robustrl.core.session import Session
from robustrl.core.watch import Delete, Put, Resync, list_prefix, next_change, watch_prefix
from tests.support import eventually, stopped
from tests.support.cluster import started_member, stored_member
from tests.support.etcd import EtcdProcess


def member(name: str, role: str = "rollout") -> MemberRecord:
    return MemberRecord(role=role, instance_id=name, address="127.0.0.1:1", pid=1, host="h")


async def registered_r0(
    client: aetcd.Client, settings: EtcdSettings, ttl: int
) -> tuple[Registry, Session]:
    """A registry, and member r0 registered in it under a new session with this TTL."""
    registry = Registry(client, KeySpace(settings.prefix))
    session = await Session.open(client, ttl=ttl)
    await registry.register(session, member("r0"))
    return registry, session


async def test_closing_a_session_removes_its_keys_at_once(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    registry, session = await registered_r0(etcd_client, etcd_settings, ttl=30)
    assert [m.instance_id for m in (await registry.list())[0]] == ["r0"]
    await session.close()
    assert (await registry.list())[0] == []
    assert session.done.is_set()


async def test_a_refreshed_session_outlives_its_ttl_three_times_over(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    registry, session = await registered_r0(etcd_client, etcd_settings, ttl=2)

    # The span under test, not a wait: three TTLs; unrefreshed, a lease goes within 3 s (below).
    await asyncio.sleep(6.0)

    assert [m.instance_id for m in (await registry.list())[0]] == ["r0"]
    assert not session.done.is_set() and not session.lost
    await session.close()


async def test_a_session_that_stops_refreshing_expires_within_its_ttl(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    registry, session = await registered_r0(etcd_client, etcd_settings, ttl=2)
    assert session._task is not None
    # As if the process froze: no more keepalives. The flag as well as the cancel, since on
    # Python 3.11 a cancel that lands as wait_for's refresh completes is swallowed.
    session._closed = True
    session._task.cancel()

    async def gone() -> bool:
        return not (await registry.list())[0]

    took = await eventually(gone, timeout=4.0)
    assert took <= 3.0


async def test_registry_watch_sees_joins_and_leaves_in_order(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    registry = Registry(etcd_client, KeySpace(etcd_settings.prefix))
    _, revision = await registry.list()
    session = await Session.open(etcd_client, ttl=30)
    await registry.register(session, member("a"))
    await registry.register(session, member("b", role="trainer"))
    await registry.deregister(member("a"))
    events = []
    watch = registry.watch(revision + 1)
    async for event in watch:
        events.append(event)
        if len(events) == 3:
            break
    await watch.aclose()  # type: ignore[attr-defined]
    assert isinstance(events[0], Put) and b"/members/rollout/a" in events[0].entry.key
    assert isinstance(events[1], Put) and b"/members/trainer/b" in events[1].entry.key
    assert isinstance(events[2], Delete) and registry.role_and_instance(events[2].key) == (
        "rollout",
        "a",
    )
    await session.close()


async def test_watch_from_a_compacted_revision_resyncs_with_the_full_state(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    prefix = f"{etcd_settings.prefix}/w/".encode()
    first = await etcd_client.put(prefix + b"x", b"1")
    start = first.header.revision
    await etcd_client.put(prefix + b"x", b"2")
    latest = await etcd_client.put(prefix + b"y", b"3")
    await etcd_client.compact(latest.header.revision)
    stream = watch_prefix(etcd_client, prefix, start)
    event = await asyncio.wait_for(anext(stream), 5)
    await stream.aclose()  # type: ignore[attr-defined]
    assert isinstance(event, Resync)
    assert {e.key: e.value for e in event.entries} == {prefix + b"x": b"2", prefix + b"y": b"3"}


async def test_a_watch_cancelled_while_being_created_leaves_later_watches_their_own_events(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    base = f"{etcd_settings.prefix}/cw".encode()
    _, revision = await list_prefix(etcd_client, base)
    missed = []
    for i in range(10):
        doomed = asyncio.ensure_future(anext(watch_prefix(etcd_client, base + b"/gone/", 1)))
        await asyncio.sleep(0)  # it has sent its create request; etcd has not answered yet
        await asyncio.sleep(0)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        mine = base + f"/mine-{i}/".encode()
        waiting = asyncio.create_task(next_change(etcd_client, mine, revision + 1, 5.0))
        stream = watch_prefix(etcd_client, mine, revision + 1)
        put = await etcd_client.put(mine + b"k", b"v")
        revision = put.header.revision
        try:
            event = await asyncio.wait_for(anext(stream), 5)
            assert isinstance(event, Put) and event.entry.key == mine + b"k"
        except TimeoutError:
            missed.append(i)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        began = asyncio.get_running_loop().time()
        await waiting
        assert asyncio.get_running_loop().time() - began < 4, "next_change missed its key"
    assert not missed, f"watches {missed} never saw their own key"


async def test_election_hands_over_when_the_leader_resigns_or_dies(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    prefix = KeySpace(etcd_settings.prefix).election("test")
    s1, s2, s3 = [await Session.open(etcd_client, ttl=2) for _ in range(3)]
    e1, e2, e3 = (
        Election(etcd_client, prefix, s1),
        Election(etcd_client, prefix, s2),
        Election(etcd_client, prefix, s3),
    )
    await e1.campaign(b"one")
    second = asyncio.create_task(e2.campaign(b"two"))

    async def in_line() -> bool:  # its key is written, behind the leader's
        return e2.revision != 0

    await eventually(in_line, timeout=5)
    await asyncio.sleep(0.3)  # the span under test: in line behind a leader, it does not lead
    assert not second.done()
    leader = await current_leader(etcd_client, prefix)
    assert leader is not None and leader.value == b"one"

    await e1.resign()
    await asyncio.wait_for(second, 5)
    third = asyncio.create_task(e3.campaign(b"three"))

    # The leader "dies": its keepalive stops; the next candidate leads within the TTL.
    assert s2._task is not None
    s2._task.cancel()
    await asyncio.wait_for(third, s2.ttl + 2)
    leader = await current_leader(etcd_client, prefix)
    assert leader is not None and leader.value == b"three"
    await s3.close()
    await s1.close()


async def test_a_deposed_leader_cannot_write_through_its_guard(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    prefix = KeySpace(etcd_settings.prefix).election("guard")
    session = await Session.open(etcd_client, ttl=5)
    election = Election(etcd_client, prefix, session)
    await election.campaign(b"me")
    guard = election.leader_guard()
    tx = etcd_client.transactions
    key = f"{etcd_settings.prefix}/guarded".encode()
    ok, _ = await etcd_client.transaction(compare=[guard], success=[tx.put(key, b"1")], failure=[])
    assert ok
    await session.close()  # leadership gone
    ok, _ = await etcd_client.transaction(compare=[guard], success=[tx.put(key, b"2")], failure=[])
    assert not ok
    assert (await etcd_client.get(key)).value == b"1"


@pytest.mark.parametrize("ttl", [1])
async def test_session_done_fires_when_the_lease_is_revoked_elsewhere(
    etcd_client: aetcd.Client, ttl: int
) -> None:
    session = await Session.open(etcd_client, ttl=ttl)
    await etcd_client.revoke_lease(session.lease_id)
    await asyncio.wait_for(session.done.wait(), ttl + 2)
    await session.close()


async def test_observe_reports_each_leader_change(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    from robustrl.core.election import observe

    prefix = KeySpace(etcd_settings.prefix).election("observed")
    seen: list[bytes | None] = []
    stream = observe(etcd_client, prefix)
    first = await asyncio.wait_for(anext(stream), 5)
    seen.append(None if first is None else first.value)
    s1, s2 = await Session.open(etcd_client, ttl=5), await Session.open(etcd_client, ttl=5)
    await Election(etcd_client, prefix, s1).campaign(b"a")
    second = asyncio.create_task(Election(etcd_client, prefix, s2).campaign(b"b"))
    entry = await asyncio.wait_for(anext(stream), 5)
    seen.append(None if entry is None else entry.value)
    await s1.close()
    await asyncio.wait_for(second, 5)
    entry = await asyncio.wait_for(anext(stream), 5)
    seen.append(None if entry is None else entry.value)
    await stream.aclose()  # type: ignore[attr-defined]
    await s2.close()
    assert seen == [None, b"a", b"b"]


async def test_a_member_change_made_after_its_lease_expired_is_not_lost(
    etcd_settings: EtcdSettings, etcd_client: aetcd.Client
) -> None:
    """A process frozen past its TTL resumes, its lease is gone, and it changes its record
    (a fenced rollout leaving its job): the change lands under the next session, and the
    re-registration does not put the old record back."""
    settings = EtcdSettings(
        endpoints=etcd_settings.endpoints, prefix=etcd_settings.prefix, session_ttl=2
    )
    runtime = await started_member("rollout", "rollout-z", settings)
    try:
        await runtime.update_member(job_id="job-1")
        old = runtime.session
        assert old is not None
        await etcd_client.revoke_lease(old.lease_id)  # expired while frozen
        await runtime.update_member(job_id="", labels={"fenced": "true"})
        assert runtime.session is not old

        record = await stored_member(etcd_client, settings, "rollout", "rollout-z")
        assert runtime.session is not None and record is not None
        assert record.lease_id == runtime.session.lease_id
        assert record.job_id == "" and record.labels["fenced"] == "true"
    finally:
        await runtime.shutdown()


async def test_a_member_change_that_etcd_refused_is_not_kept_in_memory(
    small_etcd: str,
) -> None:
    """etcd out of space refuses a standby's "prepared" label. The record in memory keeps the
    labels etcd has, so the same change asked again once etcd takes writes is written. It
    used to stay in memory only: every later PREPARE found the standby labelled and wrote
    nothing, and the leader, which binds only a member whose record says prepared, waited for
    ever."""
    settings = EtcdSettings(endpoints=small_etcd, prefix="/robustrl-refused")
    runtime = await started_member("trainer", "standby-n", settings, {"standby": "true"})
    client = aetcd.Client(*settings.endpoint_list()[0])
    try:
        [raised] = await client.create_alarm()
        with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
            await runtime.update_member(labels={"prepared": "job-1"})
        assert runtime.member is not None and runtime.member.labels == {"standby": "true"}

        await client.disarm_alarm(raised.member_id)
        await runtime.update_member(labels={"prepared": "job-1"})

        record = await stored_member(client, settings, "trainer", "standby-n")
        assert record is not None and record.labels == {"standby": "true", "prepared": "job-1"}
    finally:
        await client.close()
        await runtime.shutdown()


async def test_a_bind_that_etcd_refused_leaves_the_instance_free(small_etcd: str) -> None:
    """A BIND whose registry write etcd refuses (out of space) fails, and the instance stays
    free: bound in memory only, it would have refused every other job while the leader, which
    reads the registry, took it for free."""
    from tests.support.role_control import SPEC, Action, CountingWorker, request

    settings = EtcdSettings(endpoints=small_etcd, prefix="/robustrl-refused")
    runtime = await started_member("trainer", "trainer-n", settings)
    role = RoleControl(runtime, CountingWorker)
    client = aetcd.Client(*settings.endpoint_list()[0])
    try:
        [raised] = await client.create_alarm()
        with pytest.raises(aetcd.exceptions.ClientError, match="database space exceeded"):
            await role.Control(request(Action.ACTION_BIND, "job-1", 1, SPEC), context=None)
        assert role.binding.job_id == "" and role.worker is None

        await client.disarm_alarm(raised.member_id)
        await role.Control(request(Action.ACTION_BIND, "job-2", 1, SPEC), context=None)

        record = await stored_member(client, settings, "trainer", "trainer-n")
        assert record is not None and record.job_id == "job-2"
        assert role.binding.job_id == "job-2"
    finally:
        await role.stop_worker()
        await client.close()
        await runtime.shutdown()


async def test_member_changes_made_at_once_all_land(
    etcd_settings: EtcdSettings, etcd_client: aetcd.Client
) -> None:
    """Changes made concurrently (a prepared label, a fence leaving the job, a new epoch) each
    land: none is overwritten by another's view of the record, in etcd or in memory (which
    the next re-registration writes)."""
    runtime = await started_member("trainer", "standby-z", etcd_settings, {"standby": "true"})
    try:
        await runtime.update_member(job_id="job-1")
        await asyncio.gather(
            runtime.update_member(labels={"prepared": "job-2"}),
            runtime.update_member(labels={"fenced": "true", "standby": None}, job_id=""),
            runtime.update_member(epoch=4),
        )
        record = await stored_member(etcd_client, etcd_settings, "trainer", "standby-z")
        assert record is not None
        assert record.labels == {"prepared": "job-2", "fenced": "true"}
        assert (record.job_id, record.epoch) == ("", 4)
        assert runtime.member == record
    finally:
        await runtime.shutdown()


async def test_a_watch_creation_that_timed_out_cannot_hand_its_watch_to_the_next(
    private_etcd: EtcdProcess,
) -> None:
    """etcd stalls (SIGSTOP) while watch A is being created: A times out, watch B is asked for
    before etcd wakes. etcd then answers A's creation first; B must still get its own events,
    and a watch that was running all along (C) must lose none of its events."""
    from robustrl.core.etcd_client import connect_etcd
    from robustrl.core.watch import _open_watch

    client = await connect_etcd(EtcdSettings(endpoints=private_etcd.endpoints, timeout=1))
    try:
        _, revision = await list_prefix(client, b"/x/")  # the watch stream exists before the stall
        await next_change(client, b"/x/", revision + 1, 0.01)
        running = watch_prefix(client, b"/c/", revision + 1)
        first = asyncio.ensure_future(anext(running))
        await client.put(b"/c/1", b"before the stall")
        early = await asyncio.wait_for(first, 5)
        assert isinstance(early, Put) and early.entry.key == b"/c/1"
        with stopped(private_etcd.proc.pid):
            with pytest.raises(aetcd.exceptions.WatchTimeoutError):
                await _open_watch(client, b"/a/", revision + 1)
            second = asyncio.ensure_future(_open_watch(client, b"/b/", revision + 1))
            watcher = client._watcher

            async def b_on_its_way() -> bool:  # pending, its request taken by the new stream
                return watcher._new_callback is not None and watcher._request_queue.empty()

            # While etcd still sleeps, and before B's own creation times out (1 s).
            await eventually(b_on_its_way, timeout=0.8, interval=0.01)
        watch = await second
        try:
            await client.put(b"/a/k", b"not B's")
            await client.put(b"/b/k", b"B's")
            event = await asyncio.wait_for(anext(aiter(watch)), 5)
            assert event.kv.key == b"/b/k", f"B was handed A's watch: got {event.kv.key!r}"
        finally:
            await watch.cancel()
        await client.put(b"/c/2", b"after the stall")
        later = await asyncio.wait_for(anext(running), 5)
        assert isinstance(later, Put) and later.entry.key == b"/c/2"
        await running.aclose()  # type: ignore[attr-defined]
    finally:
        await client.close()


async def test_a_watch_cancelled_while_its_timed_out_creation_resets_the_stream_ends(
    private_etcd: EtcdProcess,
) -> None:
    """A creation that timed out ends the client's watch stream, and aetcd's shutdown waits
    for the stream's handler under `except CancelledError: pass`. A consumer cancelled in that
    wait (as a process's exit cancels every task) must end, not swallow the cancel and retry
    the watch for ever."""
    client = await connect_etcd(EtcdSettings(endpoints=private_etcd.endpoints, timeout=1))
    consumer: asyncio.Task[None] | None = None
    try:
        _, revision = await list_prefix(client, b"/x/")
        await next_change(client, b"/x/", revision + 1, 0.01)  # the watch stream exists
        watcher = client._watcher

        async def consume() -> None:
            async for _ in watch_prefix(client, b"/late/", revision + 1, retry_delay=0.05):
                pass

        async def resetting() -> bool:  # the handler cancelled, and not ended yet
            handler = watcher._request_handler
            return handler is not None and bool(handler.cancelling()) and not handler.done()

        with stopped(private_etcd.proc.pid):
            consumer = asyncio.create_task(consume())
            # The creation times out after 1 s; the reset then cancels the stream's handler
            # and waits for it. Cancel the consumer within that wait (one turn of the loop).
            await eventually(resetting, timeout=10, interval=0)
            consumer.cancel()
            done, _ = await asyncio.wait([consumer], timeout=3)
            assert consumer in done, "the consumer swallowed its cancellation and kept retrying"
            assert consumer.cancelled()
    finally:
        if consumer is not None and not consumer.done():
            consumer.cancel()
        await client.close()


async def test_the_local_stacks_etcd_compacts_its_own_history(tmp_path: Path) -> None:
    """Without auto-compaction every ledger write stays in etcd's history until its quota is
    full; the stack's etcd is started to compact (here with a 1 s retention, not 5 min)."""
    state = StackState(home=str(tmp_path))
    proc = start_etcd(state, history="1s")
    try:
        wait_until(lambda: etcd_healthy(state.etcd_endpoints), 30, "etcd to answer", [proc])
        client = await connect_etcd(EtcdSettings(endpoints=state.etcd_endpoints))
        try:
            first = await client.put(b"/h/k", b"0")
            for i in range(1, 20):
                await client.put(b"/h/k", str(i).encode())

            async def history_gone() -> bool:
                await client.put(b"/h/tick", b"")  # gives the compactor a later revision
                stream = watch_prefix(client, b"/h/", first.header.revision)
                event = await asyncio.wait_for(anext(stream), 5)
                await stream.aclose()  # type: ignore[attr-defined]
                return isinstance(event, Resync)

            await eventually(history_gone, timeout=30, interval=0.5)
        finally:
            await client.close()
    finally:
        stop_procs([proc])


async def _write_history(client: aetcd.Client, key: bytes, writes: int, size: int) -> int:
    """`writes` puts of a `size`-byte value to key; returns the first one's revision."""
    first = await client.put(key, b"0" * size)
    for i in range(1, writes):
        await client.put(key, str(i % 10).encode() * size)
    return int(first.header.revision)


async def test_a_watch_catches_up_on_more_history_than_one_default_grpc_message_holds(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    """etcd answers a catch-up with up to 1000 revisions at once: with a 5 KB value that is
    5 MB, past gRPC's default 4 MiB, and the watch broke and reopened at the same revision
    forever. connect_etcd's clients take messages as large as etcd sends."""
    prefix = f"{etcd_settings.prefix}/big/".encode()
    first = await _write_history(etcd_client, prefix + b"ledger", 1100, 5000)
    stream = watch_prefix(etcd_client, prefix, first)
    seen = 0
    while seen < 1100:
        event = await asyncio.wait_for(anext(stream), 10)
        assert isinstance(event, Put)
        seen += 1
    await stream.aclose()  # type: ignore[attr-defined]


async def test_history_too_large_to_receive_resyncs_instead_of_retrying_forever(
    etcd_client: aetcd.Client, etcd_settings: EtcdSettings
) -> None:
    """A client that cannot take etcd's catch-up answer (here one limited to 1 MiB messages)
    gets the prefix's current state as a Resync after a few failed reopenings."""
    prefix = f"{etcd_settings.prefix}/big/".encode()
    first = await _write_history(etcd_client, prefix + b"ledger", 400, 5000)
    host, port = etcd_settings.endpoint_list()[0]
    small = aetcd.Client(host=host, port=port, options={"grpc.max_receive_message_length": 1 << 20})
    try:
        stream = watch_prefix(small, prefix, first, retry_delay=0.05)
        event = await asyncio.wait_for(anext(stream), 10)
        assert isinstance(event, Resync)
        assert [(e.key, e.value) for e in event.entries] == [(prefix + b"ledger", b"9" * 5000)]
        later = await etcd_client.put(prefix + b"after", b"x")
        event = await asyncio.wait_for(anext(stream), 10)
        assert isinstance(event, Put) and event.entry.mod_revision == later.header.revision
        await stream.aclose()  # type: ignore[attr-defined]
    finally:
        await small.close()


async def test_work_waiting_on_an_unreachable_etcd_goes_on_once_it_answers(
    private_etcd: EtcdProcess,
) -> None:
    """until_etcd_answers: a read made while etcd is stopped (each try times out) returns the
    value once etcd wakes; `on_wait` is told once. An answer that is an error is raised."""
    from robustrl.core.etcd_client import until_etcd_answers

    client = await connect_etcd(EtcdSettings(endpoints=private_etcd.endpoints, timeout=1))
    try:
        await client.put(b"/u/k", b"kept")
        waits: list[float] = []
        tries = 0

        async def read() -> bytes:
            nonlocal tries
            tries += 1
            got = await client.get(b"/u/k")
            assert got is not None
            return bytes(got.value)

        with stopped(private_etcd.proc.pid):
            waiting = asyncio.ensure_future(
                until_etcd_answers(read, "reading", on_wait=lambda: waits.append(1.0))
            )

            async def retried_twice() -> bool:  # two tries timed out, a third is under way
                return tries >= 3

            await eventually(retried_twice, timeout=10)
            assert not waiting.done() and tries >= 2 and waits == [1.0]
        assert await asyncio.wait_for(waiting, 10) == b"kept"
        assert waits == [1.0]

        async def refused() -> None:
            await client.get(b"")  # etcd answers: an empty key is an invalid argument

        with pytest.raises(aetcd.exceptions.ClientError) as raised:
            await until_etcd_answers(refused, "reading nothing")
        assert not isinstance(raised.value, ETCD_UNREACHABLE)
    finally:
        await client.close()
