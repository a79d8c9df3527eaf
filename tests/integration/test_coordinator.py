"""The Coordinator API against real replicas and a real etcd: the outcomes and the codes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import grpc
import pytest

from robustrl.cli.client import StackClient
from robustrl.contracts import packed
from robustrl.contracts.errors import (
    LEADER_METADATA_KEY,
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotLeader,
    Unavailable,
)
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.ledger import dropped_pages
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import coordinator_pb2 as pb
from services.coordinator import policy, work
from services.coordinator.jobs import JobRecord, Phase, new_job, transition
from services.coordinator.store import JobStore
from tests.support import eventually
from tests.support.cli import REPO
from tests.support.cluster import (
    SPEC,
    accepts_writes,
    code_of,
    leader_of,
    lone_leader,
    started_member,
    stub,
)


async def test_submit_get_list_watch_cancel(coordinators: list[ServiceRuntime]) -> None:
    leader, follower = coordinators
    channel, api = stub(leader)
    async with channel:
        job = await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, overrides=["seed=7"]), timeout=5)
        assert job.job_id.startswith("arith-") and job.phase == pb.JOB_PHASE_PENDING
        assert '"seed": 7' in job.spec_json

        # Reads are served by every replica, followers included.
        f_channel, f_api = stub(follower)
        async with f_channel:
            got = await f_api.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=5)
            assert got == job
            listed = await f_api.ListJobs(pb.ListJobsRequest(), timeout=5)
            assert [j.job_id for j in listed.jobs] == [job.job_id]

        watch = api.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=10)
        first = await watch.read()
        assert first.job.phase == pb.JOB_PHASE_PENDING and first.revision == job.revision
        cancelled = await api.CancelJob(
            pb.CancelJobRequest(job_id=job.job_id, reason="r"), timeout=5
        )
        # The leader may touch the pending record (a bind attempt's message) before the
        # cancel lands: each such event still shows the job pending, and comes in order.
        live = [await watch.read()]
        while live[-1].job.phase == pb.JOB_PHASE_PENDING:
            live.append(await watch.read())
        watch.cancel()
        second = live[-1]
        assert second.job.phase == pb.JOB_PHASE_CANCELLED == cancelled.phase
        assert second.job.message == "r" and second.revision > first.revision
        assert [e.revision for e in live] == sorted({e.revision for e in live})

        # Resuming from a revision replays only what came after it.
        resumed = api.WatchJob(
            pb.WatchJobRequest(job_id=job.job_id, after_revision=first.revision), timeout=10
        )
        replayed = [await resumed.read() for _ in live]
        resumed.cancel()
        assert [e.revision for e in replayed] == [e.revision for e in live]
        assert replayed[-1].revision == second.revision
        assert replayed[-1].job.phase == pb.JOB_PHASE_CANCELLED

        only_pending = await api.ListJobs(
            pb.ListJobsRequest(phases=[pb.JOB_PHASE_PENDING]), timeout=5
        )
        assert list(only_pending.jobs) == []


async def test_bad_requests_get_the_right_code_and_change_nothing(
    coordinators: list[ServiceRuntime],
) -> None:
    leader, follower = coordinators
    channel, api = stub(leader)
    async with channel:
        job = await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="j1"), timeout=5)
        cases = [
            (
                api.SubmitJob(pb.SubmitJobRequest(spec="name: x\ntrainer: {lr: 0}\n"), timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT,
                "trainer.lr",
            ),
            (
                api.SubmitJob(pb.SubmitJobRequest(spec="::: not yaml :::\n - ["), timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT,
                "YAML",
            ),
            (
                api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="BAD"), timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT,
                "job id",
            ),
            (
                api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="j1"), timeout=5),
                grpc.StatusCode.ALREADY_EXISTS,
                "j1",
            ),
            (
                api.GetJob(pb.GetJobRequest(job_id="nope"), timeout=5),
                grpc.StatusCode.NOT_FOUND,
                "nope",
            ),
            (
                api.CancelJob(pb.CancelJobRequest(job_id="nope"), timeout=5),
                grpc.StatusCode.NOT_FOUND,
                "nope",
            ),
            (
                api.CancelJob(
                    pb.CancelJobRequest(job_id="j1", expected_revision=job.revision + 99), timeout=5
                ),
                grpc.StatusCode.ABORTED,
                "revision",
            ),
        ]
        for call, code, text in cases:
            error = await code_of(call)
            assert error.code() == code, (code, error.details())
            assert text in (error.details() or "")

        await api.CancelJob(pb.CancelJobRequest(job_id="j1"), timeout=5)
        error = await code_of(api.CancelJob(pb.CancelJobRequest(job_id="j1"), timeout=5))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already CANCELLED" in (error.details() or "")

        listed = await api.ListJobs(pb.ListJobsRequest(), timeout=5)
        assert [(j.job_id, j.phase) for j in listed.jobs] == [("j1", pb.JOB_PHASE_CANCELLED)]

    # A write to a follower: UNAVAILABLE, naming the leader in the message and the metadata.
    f_channel, f_api = stub(follower)
    async with f_channel:
        error = await code_of(f_api.SubmitJob(pb.SubmitJobRequest(spec=SPEC), timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert leader.address in (error.details() or "")
        assert dict(error.trailing_metadata() or ())[LEADER_METADATA_KEY] == leader.address


async def test_a_job_whose_data_cannot_be_had_is_refused_at_submit_and_not_recorded(
    coordinators: list[ServiceRuntime], tmp_path: Path
) -> None:
    leader, _ = coordinators
    good = {"id": "r", "prompt": "1+1=", "answer": "2"}
    rows = [json.dumps({**good, "id": f"r{i}"}) for i in range(1, 7)]
    (tmp_path / "bad-row.jsonl").write_text("\n".join([*rows, "{oops", ""]))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    cases = [
        ("task.dataset=/nowhere/rows.jsonl", "/nowhere/rows.jsonl"),
        (f"task.dataset={tmp_path / 'empty.jsonl'}", "empty.jsonl: no rows"),
        (
            f"task.dataset={tmp_path / 'rows.jsonl'}",
            "rows.jsonl, row 1: no column 'question' (columns: answer, id, prompt)",
            "task.prompt_column=question",
        ),
        (f"task.dataset={tmp_path / 'bad-row.jsonl'}", "bad-row.jsonl, row 7: not valid JSON"),
        ("task.name=math", "task.eval_dataset: the math task has no built-in held-out rows"),
    ]
    channel, api = stub(leader)
    async with channel:
        for override, text, *more in cases:
            request = pb.SubmitJobRequest(spec=SPEC, job_id="data", overrides=[override, *more])
            error = await code_of(api.SubmitJob(request, timeout=10))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (override, error.details())
            assert text in (error.details() or ""), error.details()
            assert "task." in (error.details() or "")
        listed = await api.ListJobs(pb.ListJobsRequest(), timeout=5)
        assert list(listed.jobs) == []
        ok = pb.SubmitJobRequest(
            spec=SPEC, job_id="data", overrides=[f"task.dataset={tmp_path / 'rows.jsonl'}"]
        )
        assert (await api.SubmitJob(ok, timeout=10)).job_id == "data"


async def test_a_lost_compare_and_swap_is_aborted(coordinators: list[ServiceRuntime]) -> None:
    leader = coordinators[0]
    channel, api = stub(leader)
    async with channel:
        job = await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="cas"), timeout=5)
    assert leader.client is not None
    store = JobStore(leader.client, leader.keys)
    record, revision = await store.get("cas")
    await store.update(record.model_copy(update={"step": 1}), revision, [])
    with pytest.raises(Aborted):
        await store.update(record.model_copy(update={"step": 2}), revision, [])
    assert (await store.get("cas"))[0].step == 1 and job.revision == revision


async def test_the_standby_takes_over_and_every_job_survives(
    coordinators: list[ServiceRuntime],
) -> None:
    leader, follower = coordinators
    channel, api = stub(leader)
    async with channel:
        for i in range(3):
            await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id=f"keep-{i}"), timeout=5)
        await api.CancelJob(pb.CancelJobRequest(job_id="keep-1"), timeout=5)
        before = await api.ListJobs(pb.ListJobsRequest(), timeout=5)
    await leader.shutdown()

    async def follower_leads() -> bool:
        return await leader_of([follower]) is follower and await accepts_writes(follower)

    await eventually(follower_leads, timeout=5)
    f_channel, f_api = stub(follower)
    async with f_channel:
        after = await f_api.ListJobs(pb.ListJobsRequest(), timeout=5)
        assert [(j.job_id, j.phase, j.spec_json) for j in after.jobs] == [
            (j.job_id, j.phase, j.spec_json) for j in before.jobs
        ]
        # The new leader accepts writes.
        await f_api.CancelJob(pb.CancelJobRequest(job_id="keep-0"), timeout=5)


async def test_members_view_marks_the_leader(coordinators: list[ServiceRuntime]) -> None:
    leader = coordinators[0]
    channel, api = stub(leader)
    async with channel:
        reply = await api.ListMembers(pb.ListMembersRequest(), timeout=5)
    roles = sorted((m.instance_id, m.leader) for m in reply.members)
    assert roles == sorted(
        [(leader.instance_id, True), (coordinators[1].instance_id, False), ("monitor-0", False)]
    )
    assert reply.leader_instance_id == leader.instance_id


async def test_a_new_leader_reloads_records_stored_as_plain_json_and_writes_them_compressed(
    etcd_settings: EtcdSettings,
) -> None:
    """A real leader and etcd holding a job's ledger and ETTR account as plain JSON (as they
    were stored before they were compressed): elected, the leader carries on with both and the
    CLI reads them; its next write of the ledger is compressed, and a leader elected after it
    reloads that."""
    from robustrl.contracts.ettr import EttrAccount

    async with lone_leader(etcd_settings, "plain") as (runtime, leadership, driver):
        client = await StackClient.connect(etcd_settings.endpoints, etcd_settings.prefix)
        try:
            assert runtime.client is not None
            keys = runtime.keys
            record = new_job("pl", {"id": "pl"}, 1.0)
            await JobStore(runtime.client, keys).create(record, leadership.guard())
            ledger = work.WorkLedger(job_id="pl")
            groups = work.lease(
                ledger, instance_id="r", epoch=1, max_groups=40, budget=40, now=0, lease_seconds=60
            )
            work.complete(ledger, "r", groups[:30])
            account = EttrAccount(started_at=3.0, folded_s=2.5, folded_through_step=7)
            await runtime.client.put(keys.work("pl"), ledger.model_dump_json().encode())
            await runtime.client.put(keys.ettr("pl"), account.model_dump_json().encode())

            await driver.on_elected()

            assert driver.accounting.ledger("pl") == ledger
            assert driver.accounts["pl"] == account
            summary = await client.work_summary("pl")
            assert summary is not None and summary["delivered"] == 30 and summary["open"] == 10

            work.complete(driver.accounting.ledger("pl"), "r", groups[30:])
            await driver.save_ledger(driver.accounting.ledger("pl"))
            stored = await runtime.client.get(keys.work("pl"))
            assert stored is not None
            assert len(stored.value) * 4 < len(driver.accounting.ledger("pl").model_dump_json())
            await driver.on_elected()
            assert driver.accounting.ledger("pl").delivered == groups
        finally:
            await client.close()


async def test_an_unreadable_record_costs_its_own_job_and_never_the_election(
    etcd_settings: EtcdSettings,
) -> None:
    """A real etcd holding a corrupt ledger for one running job, a ledger in a shape this
    release does not know for a finished one, and a corrupt ETTR account for a healthy running
    job. A coordinator elected over them leads (the takeover used to fail and retry forever,
    for every job), fails only the job whose ledger it cannot read, with why, keeps the other
    running with its ledger, and leaves every unreadable value in etcd as it was."""
    async with lone_leader(etcd_settings, "writer") as (runtime, leadership, _):
        assert runtime.client is not None
        keys = runtime.keys
        for job_id, phase in (
            ("bad", Phase.RUNNING),
            ("ok", Phase.RUNNING),
            ("old", Phase.CANCELLED),
        ):
            record = transition(new_job(job_id, {"name": job_id}, 0.0), phase, "x", now=0.0)
            await JobStore(runtime.client, keys).create(record, leadership.guard())
        healthy = work.WorkLedger(job_id="ok")
        work.lease(
            healthy, instance_id="r", epoch=1, max_groups=4, budget=4, now=0, lease_seconds=60
        )
        unreadable = {
            keys.work("bad"): b"\x78\x01garbage",
            keys.work("old"): b'{"job_id": "old", "open": 7}',
            keys.ettr("ok"): b"{not json",
        }
        await runtime.client.put(keys.work("ok"), packed.dump(healthy))
        for key, value in unreadable.items():
            await runtime.client.put(key, value)

    async with lone_leader(etcd_settings, "reader") as (runtime, leadership, driver):
        assert leadership.is_leader and runtime.client is not None
        assert driver.accounting.ledger("ok") == healthy and "ok" not in driver.accounts
        await driver.tick()

        bad, _ = await driver.store.get("bad")
        assert bad.phase is Phase.FAILED
        assert "work ledger" in bad.message and "cannot be read" in bad.message
        assert "not a WorkLedger record" in bad.message
        ok, _ = await driver.store.get("ok")
        old, _ = await driver.store.get("old")
        assert (ok.phase, old.phase) == (Phase.RUNNING, Phase.CANCELLED)
        for key, value in unreadable.items():
            stored = await runtime.client.get(key)
            assert stored is not None and stored.value == value


async def test_a_job_whose_supervision_fails_does_not_hold_up_the_jobs_after_it(
    etcd_settings: EtcdSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real leader and etcd, three running jobs listed in this order: one whose stored spec
    no longer validates is failed with why (it used to raise in every round, neither failed nor
    supervised); one whose supervision raises stays as it is; the round still supervises the
    job after both (its expired lease is taken back)."""
    async with lone_leader(etcd_settings, "isolate") as (_, leadership, driver):
        specs: dict[str, dict[str, object]] = {
            "aaa": {"unknown": 1},
            "bbb": {"name": "bbb"},
            "zzz": {"name": "zzz"},
        }
        for job_id, spec in specs.items():
            record = transition(new_job(job_id, spec, 0.0), Phase.RUNNING, "x", now=0.0)
            await driver.store.create(record, leadership.guard())
            ledger = driver.ledgers[job_id] = work.WorkLedger(job_id=job_id)
            work.lease(
                ledger, instance_id="r", epoch=1, max_groups=2, budget=2, now=0, lease_seconds=1
            )
            await driver.save_ledger(ledger)
        supervise = driver.supervisor.supervise

        async def raising_for_bbb(record: JobRecord, members: list[MemberRecord]) -> None:
            if record.job_id == "bbb":
                raise RuntimeError("supervision of bbb broke")
            await supervise(record, members)

        monkeypatch.setattr(driver.supervisor, "supervise", raising_for_bbb)

        await driver.tick()

        assert driver.accounting.ledger("zzz").open == {}
        assert len(driver.accounting.ledger("bbb").open) == 2
        failed, _ = await driver.store.get("aaa")
        assert failed.phase is Phase.FAILED
        assert "spec no longer validates" in failed.message and "unknown" in failed.message
        assert (await driver.store.get("bbb"))[0].phase is Phase.RUNNING

        await driver.tick()  # the failed job is released; the others are as they were
        assert (await driver.store.get("aaa"))[0].phase is Phase.FAILED
        assert "aaa" not in driver.ledgers


async def test_a_round_supervises_the_job_record_as_it_is_once_it_holds_the_lock(
    etcd_settings: EtcdSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real leader and etcd. A round lists the jobs, then waits for a job's lock held by a
    recovery that unbinds a rollout. The round must act on the record as the recovery left
    it: acting on the copy it listed, it wrote the rollout back into the job's members (seen
    in the ETTR benchmark: a rollout fenced while a trainer's replacement was bound stayed
    unreplaced for 18 s, then was reported lost a second time)."""
    async with lone_leader(etcd_settings, "fresh") as (_, leadership, driver):
        record = transition(new_job("fr", {"name": "fr"}, 0.0), Phase.RUNNING, "x", now=0.0)
        record = record.model_copy(
            update={
                "members": ["t", "r0", "r1"],
                "member_roles": {"t": "trainer", "r0": "rollout", "r1": "rollout"},
            }
        )
        await driver.store.create(record, leadership.guard())
        driver.ledgers["fr"] = work.WorkLedger(job_id="fr")
        seen: list[JobRecord] = []

        async def noting(record: JobRecord, members: list[MemberRecord]) -> None:
            seen.append(record)

        monkeypatch.setattr(driver.supervisor, "supervise", noting)
        asked = asyncio.Event()
        lock_of = driver.jobs.lock

        def noting_the_ask(job_id: str) -> asyncio.Lock:
            # The round asks for a job's lock only once it has listed the jobs, and nothing
            # awaits between the ask and the acquire: set, the round waits on the lock.
            if job_id == "fr":
                asked.set()
            return lock_of(job_id)

        async with driver.lock("fr"):
            monkeypatch.setattr(driver.jobs, "lock", noting_the_ask)
            round_ = asyncio.create_task(driver.tick())
            await asyncio.wait_for(asked.wait(), timeout=10)  # it listed the jobs, then asked
            assert not round_.done()
            # What a rollout's recovery does under the lock: r1 leaves the job.
            await driver.jobs.update(
                "fr", {"members": ["t", "r0"], "member_roles": {"t": "trainer", "r0": "rollout"}}
            )
        await round_

        assert [r.members for r in seen] == [["t", "r0"]]


async def test_an_ask_is_spent_once_its_member_registers(etcd_settings: EtcdSettings) -> None:
    """A real leader and etcd. A rollout is lost and its replacement asked for; it registers
    and is being prepared when the job's other rollout is lost. The round counts the first
    replacement as a free member and is one short: that is one more to ask for. Counted as
    still coming as well, the first ask held the second back until it was ASKED_FOR_S old
    (seen: a poison-group job ran on one rollout for 120 s)."""
    from services.coordinator.provisioner import Provisioner

    class Naming(Provisioner):
        def __init__(self) -> None:
            self.started: list[str] = []

        async def request(self, role: str, job_id: str, reason: str, standby: bool = False) -> str:
            self.started.append(f"{role}-p{len(self.started)}")
            return self.started[-1]

    async with lone_leader(etcd_settings, "spent") as (runtime, _, driver):
        assert runtime.client is not None
        provisioner = driver.asks.provisioner = Naming()
        await driver.asks.ask("sp", "rollout", 1, set())
        await driver.asks.ask("sp", "rollout", 1, set())  # the next round: it is still coming
        assert provisioner.started == ["rollout-p0"]
        # rollout-p0 registered: counted as a free member, and the round is still one short.
        await driver.asks.ask("sp", "rollout", 1, {"rollout-p0", "trainer-0"})
        assert provisioner.started == ["rollout-p0", "rollout-p1"]
        # Spent, p0's ask stays spent if p0 goes again before it is bound: the round that
        # finds two short asks for one more, not two.
        await driver.asks.ask("sp", "rollout", 2, {"trainer-0"})
        assert provisioner.started == ["rollout-p0", "rollout-p1", "rollout-p2"]
        stored = await runtime.client.get(runtime.keys.provisioning("sp"))
        assert stored is not None
        assert [i for _, i in json.loads(stored.value)["rollout"]] == ["rollout-p1", "rollout-p2"]


async def test_a_new_leader_does_not_ask_again_for_replacements_already_asked_for(
    etcd_settings: EtcdSettings,
) -> None:
    """Real leaders and etcd, with the external provisioner (no scheduler connected, so what
    is asked waits in its list): a running job lost every member; its leader asks once for a
    trainer and two rollouts, and its next rounds do not ask again. A leader elected after it
    (the replacements still starting) does not ask again either: when they were asked for is in
    etcd. Once that is older than ASKED_FOR_S, a leader asks again; once the job ends, the
    stored asks are deleted."""
    from services.coordinator.policy import ASKED_FOR_S
    from services.coordinator.provisioner import ExternalProvisioner

    wanted = ["rollout", "rollout", "trainer"]

    def roles(provisioner: ExternalProvisioner) -> list[str]:
        return sorted(p.role for p in provisioner.pending.values())

    async with lone_leader(etcd_settings, "asks-a") as (runtime, leadership, driver):
        assert runtime.client is not None
        first = driver.provisioner = ExternalProvisioner(etcd_settings)
        record = transition(new_job("pv", {"name": "pv"}, 0.0), Phase.RUNNING, "x", now=0.0)
        await driver.store.create(record, leadership.guard())
        await driver.save_ledger(driver.ledgers.setdefault("pv", work.WorkLedger(job_id="pv")))
        await driver.tick()
        await driver.tick()
        assert roles(first) == wanted
        stored = await runtime.client.get(runtime.keys.provisioning("pv"))
        assert stored is not None and sorted(json.loads(stored.value)) == ["rollout", "trainer"]

    async with lone_leader(etcd_settings, "asks-b") as (runtime, leadership, driver):
        assert runtime.client is not None
        second = driver.provisioner = ExternalProvisioner(etcd_settings)
        await driver.tick()
        assert roles(second) == []
        long_ago = time.time() - ASKED_FOR_S - 1
        old = {"trainer": [long_ago], "rollout": [long_ago, long_ago]}
        await runtime.client.put(runtime.keys.provisioning("pv"), json.dumps(old).encode())

    async with lone_leader(etcd_settings, "asks-c") as (runtime, leadership, driver):
        assert runtime.client is not None
        third = driver.provisioner = ExternalProvisioner(etcd_settings)
        await driver.tick()
        assert roles(third) == wanted
        await driver.update_job("pv", {}, Phase.CANCELLED, "cancelled")
        await driver.tick()
        assert await runtime.client.get(runtime.keys.provisioning("pv")) is None


async def test_a_free_member_under_an_id_fenced_from_the_job_is_not_bound_to_it(
    etcd_settings: EtcdSettings,
) -> None:
    """A process restarted under the id of one that was fenced from a job (a container or pod
    restarted in place) would be told at its first beat that it is fenced, and leave the job
    again. Real leader, registry members and etcd: of two free rollouts, the one whose id is
    fenced from the job is passed over (the other is sent PREPARE, and a replacement is asked
    for in its place), and it stays free for other jobs. A pending job does not start on one
    either."""
    from robustrl.core.fences import FenceRecord, write_fence
    from services.coordinator.provisioner import ExternalProvisioner

    async with lone_leader(etcd_settings, "fenced-id") as (runtime, leadership, driver):
        assert runtime.client is not None

        async def fence(instance_id: str, job_id: str) -> None:
            """Write a fence and wait until the leader's fence watch has it."""
            assert runtime.client is not None and driver.fences is not None
            await write_fence(
                runtime.client,
                runtime.keys,
                FenceRecord(instance_id=instance_id, job_id=job_id, epoch=1, reason="lost"),
            )
            fences = driver.fences

            async def seen() -> bool:
                return fences.fences(instance_id, job_id)

            await eventually(seen, timeout=10)

        await fence("r-again", "fj")
        members = [
            await started_member("rollout", name, etcd_settings) for name in ("r-again", "r-new")
        ]
        try:
            asks = driver.provisioner = ExternalProvisioner(etcd_settings)
            record = transition(new_job("fj", {"name": "fj"}, 0.0), Phase.RUNNING, "x", now=0.0)
            await driver.store.create(record, leadership.guard())
            await driver.save_ledger(driver.ledgers.setdefault("fj", work.WorkLedger(job_id="fj")))
            await eventually(driver.jobs.members.current, timeout=10)  # the rounds read it
            await driver.tick()
            assert sorted(p.role for p in asks.pending.values()) == ["rollout", "trainer"]
            assert driver.binder.barred == {"fj": {"r-again"}}

            # A job id used again (after a delete; fences stay) does not start on a member
            # under an id fenced from its earlier run either: its one free trainer is such.
            await fence("t-again", "again")
            members.append(await started_member("trainer", "t-again", etcd_settings))
            await driver.store.create(new_job("again", {"name": "again"}, 0.0), leadership.guard())
            await eventually(driver.jobs.members.current, timeout=10)
            await driver.tick()
            record, _ = await driver.store.get("again")
            assert record.phase is Phase.PENDING
            assert record.message.endswith("(free now: 0 trainers, 2 rollouts)"), record.message
            assert driver.binder.barred["again"] == {"t-again"}
        finally:
            for member in members:
                await member.shutdown()


async def test_a_prepared_standby_lost_is_fenced_its_holder_records_go_and_it_is_refilled(
    etcd_settings: EtcdSettings,
) -> None:
    """A standby rollout prepared for a running job holds the job's weights as a relay. Lost
    (an incident naming no job), the real leader fences it from the job at the job's epoch,
    deletes its weight-holder records (no rollout goes on pulling from it), leaves other
    holders' records alone, and asks for a standby rollout in its place."""
    from robustrl.contracts.keys import WeightKeys
    from robustrl.core.role_server import PREPARED_LABEL
    from services.coordinator.provisioner import ExternalProvisioner

    async with lone_leader(etcd_settings, "standby-lost") as (runtime, leadership, driver):
        client = runtime.client
        assert client is not None and runtime.session is not None
        record = new_job("sj", {"name": "sj"}, now=0.0)
        record.member_roles = {"trainer-s": "trainer", "rollout-s": "rollout"}
        record.members = list(record.member_roles)
        record.epoch = 3
        await driver.store.create(
            transition(record, Phase.RUNNING, "x", now=0.0), leadership.guard()
        )
        standby = MemberRecord(
            role="rollout",
            instance_id="standby-x",
            address="127.0.0.1:1",
            pid=1,
            host="h",
            labels={"standby": "true", PREPARED_LABEL: "sj"},
        )
        driver.binder.prepared[standby.instance_id] = standby
        wkeys = WeightKeys(runtime.keys)
        await client.put(wkeys.holder("sj", 7, "standby-x"), b"{}")
        await client.put(wkeys.holder("sj", 7, "rollout-s"), b"{}")
        asks = driver.provisioner = ExternalProvisioner(etcd_settings)

        def lost(instance_id: str, evidence: str, at: float) -> IncidentRecord:
            """A free member's loss, as the monitor reports it (naming no job)."""
            return IncidentRecord(
                incident_id=f"i-{instance_id}",
                job_id="",
                role="rollout",
                instance_id=instance_id,
                rank=0,
                kind="MEMBER_LOST",
                evidence=evidence,
                confidence=1.0,
                detected_at=at,
                epoch=0,
            )

        await driver.free_member_lost(lost("standby-x", "its session lapsed", 1.0))

        fence = await client.get(runtime.keys.fence("standby-x"))
        assert fence is not None
        assert (json.loads(fence.value)["job_id"], json.loads(fence.value)["epoch"]) == ("sj", 3)
        assert await client.get(wkeys.holder("sj", 7, "standby-x")) is None
        assert await client.get(wkeys.holder("sj", 7, "rollout-s")) is not None
        assert [(p.role, p.message.standby) for p in asks.pending.values()] == [("rollout", True)]
        assert "standby-x" not in driver.binder.prepared

        # Lost right after it labelled itself prepared, before a round saw the label: the
        # member cache's record says so, and it is fenced and refilled all the same.
        late = standby.model_copy(update={"instance_id": "standby-y", "address": "127.0.0.1:2"})
        await driver.jobs.registry.register(runtime.session, late)

        async def cached() -> bool:
            members, _ = await driver.jobs.members.list()
            return "standby-y" in {m.instance_id for m in members}

        await eventually(cached, timeout=10)
        assert "standby-y" not in driver.binder.prepared
        await driver.free_member_lost(lost("standby-y", "refused", 2.0))
        fence = await client.get(runtime.keys.fence("standby-y"))
        assert fence is not None and json.loads(fence.value)["job_id"] == "sj", fence
        assert [p.message.standby for p in asks.pending.values()] == [True, True]


async def test_the_leader_pages_dropped_groups_out_of_the_ledger_in_the_same_write(
    etcd_settings: EtcdSettings,
) -> None:
    """A real leader and etcd: the page and the emptied ledger land together; the CLI's reader
    finds every dropped group; a regenerate request sees drops on pages; a deposed leader's
    write fails and its ledger keeps what it lists."""
    async with lone_leader(etcd_settings, "pages", ledger_page_size=3) as (
        runtime,
        leadership,
        driver,
    ):
        client = await StackClient.connect(etcd_settings.endpoints, etcd_settings.prefix)
        try:
            ledger = work.WorkLedger(job_id="pj")
            groups = work.lease(
                ledger, instance_id="r", epoch=1, max_groups=6, budget=6, now=0, lease_seconds=60
            )
            work.complete(ledger, "r", groups)
            work.record_progress(ledger, groups[3:], {g: f"stale {g}" for g in groups[:3]})

            await driver.save_ledger(ledger)

            assert ledger.pages == 1 and ledger.discarded == {} and ledger.dropped == 3
            assert runtime.client is not None
            stored = await runtime.client.get(runtime.keys.work("pj"))
            assert stored is not None
            assert packed.load(work.WorkLedger, stored.value) == ledger
            [page] = await dropped_pages(runtime.client, runtime.keys, "pj")
            assert page.discarded == {g: f"stale {g}" for g in groups[:3]}
            assert await client.dropped_groups("pj") == page.discarded
            assert await driver.accounting.paged_out_drops(ledger, [groups[0], groups[4]]) == {
                groups[0]
            }

            work.record_progress(ledger, [], {})  # nothing new: no page
            ledger.discarded["pj-g000099"] = "made up, to fill a page"
            ledger.released = {"pj-g000098": ["x"], "pj-g000097": ["y"]}
            await leadership.resign()
            with pytest.raises(NotLeader):
                await driver.save_ledger(ledger)
            assert ledger.pages == 1 and len(ledger.discarded) == 1 and len(ledger.released) == 2
            assert len(await dropped_pages(runtime.client, runtime.keys, "pj")) == 1
        finally:
            await client.close()


async def test_a_member_out_of_the_registry_is_told_to_retry_and_a_fenced_one_is_refused(
    etcd_settings: EtcdSettings,
) -> None:
    """After an etcd outage a member's record is gone until it registers again: its reports
    must be retried (UNAVAILABLE), not refused. Before, the trainer's first report after the
    outage was refused ("not bound"), and the trainer stopped on it for good."""
    async with lone_leader(etcd_settings, "bound") as (runtime, _, driver):
        record = new_job("bj", {}, now=0.0)
        record.member_roles = {"trainer-b": "trainer"}
        with pytest.raises(Unavailable, match="not in the registry now"):
            await driver.work.bound_member(record, "trainer", "trainer-b")
        with pytest.raises(FailedPrecondition, match="no longer serves job bj"):
            await driver.work.bound_member(record, "trainer", "trainer-fenced")
        member = MemberRecord(
            role="trainer", instance_id="trainer-b", address="x:1", pid=1, host="h"
        )
        assert runtime.session is not None
        await driver.registry.register(runtime.session, member)
        with pytest.raises(FailedPrecondition, match="not bound to job bj"):
            await driver.work.bound_member(record, "trainer", "trainer-b")  # released: job_id ""
        await driver.registry.register(runtime.session, member.model_copy(update={"job_id": "bj"}))
        assert (await driver.work.bound_member(record, "trainer", "trainer-b")).job_id == "bj"


async def test_the_job_fails_once_poison_groups_reach_the_limit_and_not_before(
    etcd_settings: EtcdSettings,
) -> None:
    """A real leader and etcd, the leader's own recovery of two lost rollouts: the first poison
    group is dropped and the job goes on; the second, at recovery.poison_groups, fails the job
    with why (a bug that crashes every rollout would otherwise replace rollouts forever)."""
    spec: dict[str, object] = {"name": "pg", "recovery": {"group_losses": 1, "poison_groups": 2}}
    async with lone_leader(etcd_settings, "poison") as (runtime, leadership, driver):
        record = new_job("pg", spec, now=0.0)
        record.member_roles = {
            "trainer-p": "trainer",
            "rollout-a": "rollout",
            "rollout-b": "rollout",
        }
        record.members = list(record.member_roles)
        record.epoch = 1
        record = transition(record, Phase.RUNNING, "running", now=0.0)
        await driver.store.create(record, leadership.guard())
        ledger = driver.ledgers["pg"] = work.WorkLedger(job_id="pg")
        leased = {
            holder: work.lease(
                ledger,
                instance_id=holder,
                epoch=1,
                max_groups=1,
                budget=2,
                now=time.time(),
                lease_seconds=600,
            )
            for holder in ("rollout-a", "rollout-b")
        }
        await driver.save_ledger(ledger)
        assert runtime.session is not None
        for holder in record.member_roles:  # alive: the leader's rounds leave their leases
            await driver.registry.register(
                runtime.session,
                MemberRecord(
                    role=record.member_roles[holder],
                    instance_id=holder,
                    address="x:1",
                    pid=1,
                    host="h",
                    job_id="pg",
                ),
            )

        def lost(holder: str, at: float) -> IncidentRecord:
            return IncidentRecord(
                incident_id=f"i-{holder}",
                job_id="pg",
                role="rollout",
                instance_id=holder,
                rank=0,
                kind="MEMBER_LOST",
                evidence="its session lapsed",
                confidence=1.0,
                detected_at=at,
                epoch=1,
            )

        await driver.executor.handle(lost("rollout-a", 1.0))
        after_one, _ = await driver.store.get("pg")
        assert after_one.phase is Phase.RUNNING
        assert "rollout-a" not in after_one.member_roles
        assert ledger.poisoned == 1 and set(ledger.discarded) == set(leased["rollout-a"])
        assert policy.poison_verdict("pg", driver.spec(after_one).recovery, ledger.poisoned) == ""

        await driver.executor.handle(lost("rollout-b", 2.0))
        failed, _ = await driver.store.get("pg")
        assert failed.phase is Phase.FAILED, failed
        assert "2 prompt groups were dropped as poison groups" in failed.message
        assert "recovery.poison_groups is 2" in failed.message
        assert "rollout-b" not in failed.members and "rollout-b" not in failed.member_roles
        assert ledger.poisoned == 2 and set(ledger.discarded) == {
            *leased["rollout-a"],
            *leased["rollout-b"],
        }
        assert runtime.client is not None
        stored = await runtime.client.get(runtime.keys.work("pg"))
        assert stored is not None
        assert packed.load(work.WorkLedger, stored.value).poisoned == 2

        unbounded = failed.model_copy(
            update={"spec": {**spec, "recovery": {"group_losses": 1, "poison_groups": 0}}}
        )
        driver.jobs.specs.pop("pg")
        assert (
            policy.poison_verdict("pg", driver.spec(unbounded).recovery, ledger.poisoned) == ""
        )  # 0: no limit

        # Once released, the leader keeps nothing of the ended job in memory.
        driver.supervisor.missing[("pg", "rollout-b")] = 2.0
        driver.asks.asked[("pg", "rollout")] = [(2.0, "")]
        driver.supervisor.missing[("other", "rollout-c")] = 2.0
        await driver.supervisor.release("pg", [])
        assert "pg" not in driver.ledgers and "pg" not in driver.accounts
        assert [k for k in (*driver.supervisor.missing, *driver.asks.asked) if k[0] == "pg"] == []
        assert ("other", "rollout-c") in driver.supervisor.missing


async def test_watch_waits_for_a_coordinator_then_gives_up_with_why(
    etcd_settings: EtcdSettings,
) -> None:
    """Right after an etcd outage no coordinator is registered for a moment (their leases
    lapsed): `robustrl watch` waits for one instead of failing at once (an etcd-outage chaos
    run failed so), and gives up after --patience with the reason when none comes."""
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "robustrl.cli.main",
        "--etcd",
        etcd_settings.endpoints,
        "watch",
        "nojob",
        "--patience",
        "1.5",
        cwd=REPO,
        env={**os.environ, "ROBUSTRL_ETCD_PREFIX": etcd_settings.prefix},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    took = time.monotonic() - began

    assert proc.returncode == 1
    assert "no coordinator is registered in etcd" in err.decode()
    assert took >= 1.5, f"gave up after {took:.1f}s, before its patience ran out"


async def test_delete_job_over_the_api_gets_the_right_codes(
    coordinators: list[ServiceRuntime],
) -> None:
    """Unknown and malformed ids, a job that has not ended, a follower: refused with the right
    code and nothing changes; an ended job goes, and then it is unknown."""
    leader, follower = coordinators
    channel, api = stub(leader)
    async with channel:
        await api.SubmitJob(pb.SubmitJobRequest(spec=SPEC, job_id="dj"), timeout=5)
        cases = [
            ("nope", grpc.StatusCode.NOT_FOUND, "nope"),
            ("BAD", grpc.StatusCode.INVALID_ARGUMENT, "job id"),
            ("dj", grpc.StatusCode.FAILED_PRECONDITION, "cancel it before deleting it"),
        ]
        for job_id, code, text in cases:
            error = await code_of(api.DeleteJob(pb.DeleteJobRequest(job_id=job_id), timeout=5))
            assert error.code() == code, (code, error.details())
            assert text in (error.details() or "")
        await api.GetJob(pb.GetJobRequest(job_id="dj"), timeout=5)

        await api.CancelJob(pb.CancelJobRequest(job_id="dj"), timeout=5)
        f_channel, f_api = stub(follower)
        async with f_channel:
            error = await code_of(f_api.DeleteJob(pb.DeleteJobRequest(job_id="dj"), timeout=5))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        await api.GetJob(pb.GetJobRequest(job_id="dj"), timeout=5)

        deleted = await api.DeleteJob(pb.DeleteJobRequest(job_id="dj"), timeout=5)
        assert deleted.job_id == "dj" and deleted.keys_deleted >= 1
        for call in (
            api.GetJob(pb.GetJobRequest(job_id="dj"), timeout=5),
            api.DeleteJob(pb.DeleteJobRequest(job_id="dj"), timeout=5),
        ):
            assert (await code_of(call)).code() == grpc.StatusCode.NOT_FOUND
        assert list((await api.ListJobs(pb.ListJobsRequest(), timeout=5)).jobs) == []


async def test_delete_job_removes_every_key_of_the_job_and_no_other(
    etcd_settings: EtcdSettings,
) -> None:
    """A real leader and etcd, two ended jobs whose ids share a prefix ("dk", "dk2"), each with
    a ledger, a dropped page, an ETTR account, weight versions and holders, recovery records
    and more incidents than one etcd transaction takes. Deleting "dk" removes exactly its keys;
    a member still bound to it makes the delete fail and change nothing."""
    from robustrl.contracts.incidents import new_incident
    from robustrl.contracts.keys import WeightKeys
    from robustrl.core.incident_log import IncidentLog
    from services.coordinator.jobs import Phase, new_job, transition
    from services.monitor.detectors import MemberView
    from tests.support.cluster import started_member

    member: ServiceRuntime | None = None
    async with lone_leader(etcd_settings, "delete") as (runtime, leadership, driver):
        try:
            client, keys = runtime.client, runtime.keys
            assert client is not None
            store = JobStore(client, keys)
            wkeys = WeightKeys(keys)
            incidents = IncidentLog(client, keys)
            for job_id in ("dk", "dk2"):
                record = new_job(job_id, {"id": job_id}, 1.0)
                await store.create(transition(record, Phase.CANCELLED, "done", 2.0), [])
                await client.put(keys.work(job_id), b"{}")
                await client.put(keys.dropped_page(job_id, 0), b"{}")
                await client.put(keys.ettr(job_id), b"{}")
                await client.put(wkeys.announcement(job_id), b"{}")
                for version in (1, 2):
                    await client.put(wkeys.manifest(job_id, version), b"{}")
                    await client.put(wkeys.holder(job_id, version, "trainer-0"), b"{}")
                for i in range(70 if job_id == "dk" else 2):
                    view = MemberView(role="rollout", instance_id=f"r{i}", job_id=job_id)
                    incident = new_incident(view, "MEMBER_LOST", "test", 1.0, 1000.0 + i)
                    await incidents.record(incident)
                    if i < 3:
                        await client.put(keys.recovery(job_id, incident.incident_id), b"{}")
            await client.put(keys.fence("r0"), b'{"job_id": "dk"}')

            async def snapshot() -> dict[bytes, bytes]:
                rows = await client.get_prefix(keys.prefix.encode())
                return {kv.key: kv.value for kv in rows if b"/members/" not in kv.key}

            before = await snapshot()
            member = await started_member("rollout", "rollout-bound", etcd_settings)
            await member.update_member(job_id="dk")
            with pytest.raises(FailedPrecondition, match="rollout-bound"):
                await driver.delete_job("dk", leadership.guard())
            assert await snapshot() == before
            await member.shutdown()
            member = None

            deleted = await driver.delete_job("dk", leadership.guard())

            after = await snapshot()
            gone = set(before) - set(after)
            assert deleted == len(gone) == 1 + 1 + 1 + 1 + 1 + 4 + 70 + 3
            assert all(b"dk2" not in key for key in gone)
            assert {k for k in after if b"/dk2" in k} == {k for k in before if b"/dk2" in k}
            assert keys.fence("r0") in after  # fences stay: see JobStore.delete
            left = [
                IncidentRecord.model_validate_json(v) for k, v in after.items() if b"/incid" in k
            ]
            assert [i.job_id for i in left] == ["dk2", "dk2"]
            with pytest.raises(NotFound):
                await driver.delete_job("dk", leadership.guard())
        finally:
            if member is not None:
                await member.shutdown()


async def test_requests_at_once_share_ledger_writes_and_each_waits_for_one_that_carries_it(
    etcd_settings: EtcdSettings,
) -> None:
    """A real leader and etcd: 24 rollouts' leases made at once are stored in a few writes of
    the ledger, not 24, and no caller hears its change stored before etcd's copy lists it."""
    async with lone_leader(etcd_settings, "coalesce") as (runtime, _, driver):
        assert runtime.client is not None
        client, key = runtime.client, runtime.keys.work("cw")
        ledger = work.WorkLedger(job_id="cw")
        await driver.save_ledger(ledger)
        before = await client.get(key)

        async def lease_and_save(n: int) -> None:
            groups = work.lease(
                ledger,
                instance_id=f"r{n}",
                epoch=1,
                max_groups=2,
                budget=100,
                now=0,
                lease_seconds=60,
            )
            await driver.save_ledger(ledger)
            stored = await client.get(key)
            assert stored is not None
            assert set(groups) <= set(packed.load(work.WorkLedger, stored.value).open)

        await asyncio.gather(*(lease_and_save(n) for n in range(24)))

        after = await client.get(key)
        assert before is not None and after is not None
        assert packed.load(work.WorkLedger, after.value) == ledger and len(ledger.open) == 48
        assert 1 <= after.version - before.version <= 3  # etcd counts the key's writes


async def test_a_lease_retried_with_a_new_leader_gets_the_groups_the_old_one_stored(
    etcd_settings: EtcdSettings,
) -> None:
    """The leader stores a lease and goes before its answer arrives: the rollout asks again,
    with the same request id, of the next leader, which reloads the ledger from etcd and answers
    with the same groups. Before, those groups stayed leased to a rollout that never knew of
    them until their lease ran out (a minute), and filled the job's budget meanwhile: a leader
    killed mid-lease stalled a chaos test's job for 60 s."""
    rollout = await started_member("rollout", "r1", etcd_settings)
    try:
        await rollout.update_member(job_id="rl")
        ask = pb.LeaseWorkRequest(
            job_id="rl", instance_id="r1", epoch=1, max_groups=4, request_id="ask-1"
        )
        async with lone_leader(etcd_settings, "first") as (_, leadership, driver):
            record = transition(new_job("rl", {"name": "arith"}, 0.0), Phase.RUNNING, "x", now=0)
            await driver.store.create(record, leadership.guard())
            driver.ledgers["rl"] = work.WorkLedger(job_id="rl")
            first = [g.group_id for g in (await driver.work.lease_work(ask)).groups]  # answer lost
            assert first == [work.group_id("rl", i) for i in range(4)]
        async with lone_leader(etcd_settings, "second") as (_, _, driver):
            again = await driver.work.lease_work(ask)
            assert [g.group_id for g in again.groups] == first
            ledger = driver.accounting.ledger("rl")
            assert ledger.next_index == 4 and set(ledger.open) == set(first)
            assert all(g.prompt for g in again.groups)
            # A new ask is new work.
            fresh = await driver.work.lease_work(
                pb.LeaseWorkRequest(
                    job_id="rl", instance_id="r1", epoch=1, max_groups=2, request_id="ask-2"
                )
            )
            assert [g.group_id for g in fresh.groups] == [work.group_id("rl", i) for i in (4, 5)]
            with pytest.raises(InvalidArgument, match="request_id is longer"):
                await driver.work.lease_work(
                    pb.LeaseWorkRequest(
                        job_id="rl", instance_id="r1", epoch=1, max_groups=2, request_id="x" * 129
                    )
                )
            assert driver.accounting.ledger("rl").next_index == 6
    finally:
        await rollout.shutdown()
