"""Two trainer ranks on gloo, each a trainer member of its own: rank 0 in this process, as the
trainer worker runs it (registered, its store's address published as the rendezvous in etcd),
rank 1 a real trainer service process that this test starts (not rank 0: neither is the
other's child) and binds with Control BIND at rank 1, as the leader does. Both beat to a real
monitor. They train alike; rank 1 stopped between steps is named by a collective hang; rank 1
failing in a step fails rank 0's step at once; a rank never joins another epoch's group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from robustrl.contracts.errors import Fenced
from robustrl.contracts.jobspec import FaultSpec, JobSpec, ModelSpec, TrainerSpec
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings, member_argv, member_env
from robustrl.core.heartbeat import Progress
from robustrl.core.incident_log import IncidentLog
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import monitor_pb2, monitor_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from robustrl.weights.ucx.transport import UcxTransport, make_transport
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from services.trainer.config import TrainerSettings
from services.trainer.grpo import (
    GRPOTrainer,
    Sample,
    StepMetrics,
    completion_logprobs,
    grpo_config,
)
from services.trainer.publishing import publish_share, share_settings
from services.trainer.ranks import (
    GroupBroken,
    LeaderRanks,
    RankGroup,
    ShareSettings,
    WrongGroup,
    fingerprint,
    rendezvous,
)
from services.trainer.worker import JOB_ERRORS
from tests.support import eventually, process_state
from tests.support.paths import REPO

JOB = "ranks-job"
BUDGET = 1.0
"""The monitor's collective budget here: the incident must come within it (plus a round)."""
RANK_1 = "trainer-1"

Action = trainer_pb2.ControlRequest


@pytest.fixture
async def fast_monitor(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    runtime = await serve_monitor(
        MonitorSettings(instance_id="monitor-0", collective_budget=BUDGET), etcd_settings
    )
    yield runtime
    await runtime.shutdown()


@pytest.fixture
async def rank_0(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    """Rank 0's runtime: registered as trainer-0, bound to JOB, beating every 0.1 s."""
    settings = TrainerSettings(instance_id="trainer-0", heartbeat_interval=0.1)
    runtime = ServiceRuntime("trainer", settings, etcd_settings, service_names=[])
    await runtime.start()
    runtime.progress.job_id = JOB
    await runtime.update_member(job_id=JOB, epoch=1)
    yield runtime
    await runtime.shutdown()


@pytest.fixture
async def trainer_1(etcd_settings: EtcdSettings, tmp_path: Path) -> AsyncIterator[MemberRecord]:
    """A trainer service process of its own (`python -m services.trainer`), free; its record."""
    env = {
        **os.environ,
        **member_env(etcd_settings.endpoints, etcd_settings.prefix, "trainer", RANK_1),
        "ROBUSTRL_TRAINER_PORT": "0",
        "ROBUSTRL_TRAINER_HEARTBEAT_INTERVAL": "0.1",
        "ROBUSTRL_TRAINER_TORCH_THREADS": "1",
        "ROBUSTRL_TRAINER_RUNS_DIR": str(tmp_path / "runs"),
    }
    log_path = tmp_path / "trainer-1.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *member_argv("trainer"), cwd=REPO, env=env, stdout=log, stderr=log
        )
    try:
        from robustrl.contracts.keys import KeySpace
        from robustrl.core.etcd_client import connect_etcd
        from robustrl.core.registry import Registry

        client = await connect_etcd(etcd_settings)
        registry = Registry(client, KeySpace(etcd_settings.prefix))
        found: list[MemberRecord] = []

        async def registered() -> bool:
            member = await registry.get("trainer", RANK_1)
            found[:] = [member] if member is not None else []
            return bool(found)

        await eventually(registered, timeout=60)
        await client.close()
        yield found[0]
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        print(log_path.read_text()[-3000:])


async def _control(
    member: MemberRecord,
    action: trainer_pb2.ControlRequest.Action.ValueType,
    epoch: int,
    args: dict[str, str] | None = None,
) -> trainer_pb2.ControlResponse:
    async with grpc.aio.insecure_channel(member.address) as channel:
        return await trainer_pb2_grpc.TrainerStub(channel).Control(
            trainer_pb2.ControlRequest(action=action, job_id=JOB, epoch=epoch, args=args or {}),
            timeout=120,
        )


async def _health(monitor: ServiceRuntime) -> dict[str, monitor_pb2.MemberHealth]:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        reply = await monitor_pb2_grpc.MonitorStub(channel).GetHealth(
            monitor_pb2.GetHealthRequest(job_id=JOB), timeout=5
        )
    return {m.instance_id: m for m in reply.members}


async def _rank_1_reaches(monitor: ServiceRuntime, phase: str, timeout: float) -> None:
    """Until the monitor sees rank 1 beat `phase`."""

    async def there() -> bool:
        return (await _health(monitor))[RANK_1].phase == phase

    await eventually(there, timeout=timeout)


def _batch(trainer: GRPOTrainer, step: int) -> list[Sample]:
    prompts = [[1, 5, 4, 6, 16], [1, 7, 4, 8, 16], [1, 9, 4, 9, 16], [1, 6, 4, 7, 16]]
    completions = [[7, 2], [8, 9, 2], [10], [11 + step, 2]]
    probes = [Sample(p, c, [0.0] * len(c), 0.0) for p, c in zip(prompts, completions, strict=True)]
    logprobs = completion_logprobs(trainer.model, probes, trainer.pad_id, 1.0)
    advantages = [1.0, -1.0, 0.5, -0.5]
    return [
        Sample(p.prompt_ids, p.completion_ids, lp, a)
        for p, lp, a in zip(probes, logprobs, advantages, strict=True)
    ]


def _load(spec: JobSpec) -> GRPOTrainer:
    """The GRPO trainer of the model at `model.path`, loaded as the worker loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32)
    return GRPOTrainer(model, grpo_config(spec), pad_id=int(tokenizer.pad_token_id))


async def _form_group(
    runtime: ServiceRuntime,
    member: MemberRecord,
    spec: JobSpec,
    epoch: int = 1,
    shares: ShareSettings | None = None,
) -> tuple[GRPOTrainer, LeaderRanks]:
    """Rank 0 hosts and publishes the rendezvous; rank 1 is bound (BIND, rank 1) and joins."""
    # Off the event loop, as the worker loads: a loop stalled past the session TTL loses the
    # lease the rendezvous record is written under.
    trainer = await asyncio.to_thread(_load, spec)
    sharded = spec.trainer.strategy == "fsdp"
    leader = LeaderRanks(
        runtime.progress, world_size=2, timeout_s=60, epoch=epoch, sharded=sharded, shares=shares
    )
    master = await asyncio.to_thread(leader.listen)
    assert runtime.client is not None and runtime.session is not None
    meeting = rendezvous.Rendezvous(job_id=JOB, epoch=epoch, master=master, world_size=2)
    await rendezvous.publish(runtime.client, runtime.keys, meeting, runtime.session.lease_id)
    await _control(
        member, Action.ACTION_BIND, epoch, {"spec_json": spec.model_dump_json(), "rank": "1"}
    )
    await asyncio.to_thread(leader.start, trainer)
    return leader.sharded or trainer, leader


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_rank_member_bound_by_the_leader_trains_alike_and_is_named_when_stopped(
    rank_0: ServiceRuntime,
    trainer_1: MemberRecord,
    fast_monitor: ServiceRuntime,
    tiny_model_dir: Path,
) -> None:
    spec = JobSpec(
        name="ranks", model=ModelSpec(path=str(tiny_model_dir)), trainer=TrainerSpec(world_size=2)
    )
    trainer, leader = await _form_group(rank_0, trainer_1, spec)
    stepping: asyncio.Task[StepMetrics] | None = None
    try:
        assert rank_0.registry is not None
        member = await rank_0.registry.get("trainer", RANK_1)
        assert member is not None and member.pid == trainer_1.pid
        assert (member.job_id, member.epoch) == (JOB, 1)
        assert member.labels == {"rank": "1", "follower": "true"}

        # A few steps: the ranks' parameters stay identical (rank 0 checks every step).
        for step in range(2):
            metrics = await asyncio.to_thread(
                leader.step, trainer, _batch(trainer, step), step=step
            )
            assert metrics.stepped and metrics.num_samples == 4 and metrics.num_tokens == 8
            assert leader.fingerprints[0] == leader.fingerprints[1] == fingerprint(trainer.model)

        async def rank_1_waits_for_step_3() -> bool:
            rank1 = (await _health(fast_monitor)).get(RANK_1)
            return (
                rank1 is not None
                and rank1.counters["step"] == 2
                and (rank1.phase == "waiting_data")
            )

        await eventually(rank_1_waits_for_step_3, timeout=10)
        # Rank 1 stopped (SIGSTOP) while it waits for the next batch: rank 0 sends it and
        # waits in the broadcast that rank 1 never enters.
        os.kill(trainer_1.pid, signal.SIGSTOP)

        async def rank_1_stopped() -> bool:
            return process_state(trainer_1.pid) in ("T", "t")

        await eventually(rank_1_stopped, timeout=10)
        stopped_at = time.time()
        stepping = asyncio.create_task(
            asyncio.to_thread(leader.step, trainer, _batch(trainer, 2), step=2)
        )
        assert fast_monitor.client is not None
        log = IncidentLog(fast_monitor.client, fast_monitor.keys)

        async def collective_hang_reported() -> bool:
            incidents, _ = await log.list(JOB)
            return any(i.kind == "COLLECTIVE_HANG" for i in incidents)

        await eventually(collective_hang_reported, timeout=BUDGET + 10)
        incidents, _ = await log.list(JOB)
        [hang] = [i for i in incidents if i.kind == "COLLECTIVE_HANG"]
        assert (hang.instance_id, hang.rank, hang.epoch) == (RANK_1, 1, 1)
        assert "rank 1 has not entered it" in hang.evidence
        assert hang.detected_at - stopped_at < BUDGET + 5.0

        # Let it go: the step completes on both ranks, and they still agree.
        os.kill(trainer_1.pid, signal.SIGCONT)
        metrics = await asyncio.wait_for(stepping, 30)
        stepping = None
        assert metrics.stepped and leader.fingerprints[0] == leader.fingerprints[1]

        # The end of the job's work: rank 1 is done and stays bound until released.
        await asyncio.to_thread(leader.close)

        await _rank_1_reaches(fast_monitor, "done", timeout=10)
        await _control(trainer_1, Action.ACTION_RELEASE, 1)
        member = await rank_0.registry.get("trainer", RANK_1)
        assert member is not None and member.job_id == "" and member.labels == {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(trainer_1.pid, signal.SIGCONT)
        if stepping is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stepping, 60)
        await asyncio.to_thread(leader.close, 2.0)


@pytest.mark.timeout(180)
async def test_a_rank_that_fails_in_a_step_fails_rank_0s_step_at_once(
    rank_0: ServiceRuntime,
    trainer_1: MemberRecord,
    fast_monitor: ServiceRuntime,
    tiny_model_dir: Path,
) -> None:
    """Rank 1 raises inside step 2 (`faults.error_rank`, as a device error would) and leaves
    the group: rank 0's step fails as soon as rank 1's connections close, not at the 60 s
    collective timeout. It is a machine failing, not the job: the leader replaces the group."""
    spec = JobSpec(
        name="ranks",
        model=ModelSpec(path=str(tiny_model_dir)),
        trainer=TrainerSpec(world_size=2),
        faults=FaultSpec(error_steps=[2], error_rank=1),
    )
    trainer, leader = await _form_group(rank_0, trainer_1, spec)
    try:
        first = await asyncio.to_thread(leader.step, trainer, _batch(trainer, 0), step=0)
        assert first.stepped
        before = fingerprint(trainer.model)
        started = time.monotonic()
        with pytest.raises(GroupBroken, match=r"in step 2: ") as raised:
            await asyncio.to_thread(leader.step, trainer, _batch(trainer, 1), step=1)
        took = time.monotonic() - started
        assert took < 15, f"rank 0 learnt of rank 1's failure after {took:.1f}s"
        assert not isinstance(raised.value, JOB_ERRORS)
        # The failed step changed nothing on rank 0: no optimizer step without rank 1's part.
        assert fingerprint(trainer.model) == before

        await _rank_1_reaches(fast_monitor, "stopped_on_error", timeout=10)
        closing = time.monotonic()
        await asyncio.to_thread(leader.close)
        assert time.monotonic() - closing < 5  # the broken group is not asked to stop again
    finally:
        await asyncio.to_thread(leader.close, 2.0)


@pytest.mark.timeout(180)
async def test_a_rank_never_joins_the_group_of_another_epoch(
    rank_0: ServiceRuntime,
    trainer_1: MemberRecord,
    fast_monitor: ServiceRuntime,
    tiny_model_dir: Path,
) -> None:
    """A rank bound at epoch 1 (a fenced group's) finds the rendezvous of epoch 2: it was
    replaced, and it stops without joining. A rank that reached a store of another epoch
    (the record changed after it read it) refuses it."""
    spec = JobSpec(
        name="ranks", model=ModelSpec(path=str(tiny_model_dir)), trainer=TrainerSpec(world_size=2)
    )
    leader = LeaderRanks(rank_0.progress, world_size=2, timeout_s=60, epoch=2)
    try:
        master = await asyncio.to_thread(leader.listen)
        assert rank_0.client is not None and rank_0.session is not None
        newer = rendezvous.Rendezvous(job_id=JOB, epoch=2, master=master, world_size=2)
        await rendezvous.publish(rank_0.client, rank_0.keys, newer, rank_0.session.lease_id)
        with pytest.raises(Fenced, match="meets at epoch 2; this rank was bound at 1"):
            await rendezvous.meet(rank_0.client, rank_0.keys, JOB, 1, timeout_s=5)
        await _control(
            trainer_1, Action.ACTION_BIND, 1, {"spec_json": spec.model_dump_json(), "rank": "1"}
        )

        await _rank_1_reaches(fast_monitor, "stopped_on_error", timeout=30)
        stale = RankGroup(1, 2, master, Progress(), timeout_s=10, epoch=1)
        with pytest.raises(WrongGroup, match="serves the group of epoch 2"):
            await asyncio.to_thread(stale.init)
        stale.close()
        await rendezvous.withdraw(rank_0.client, rank_0.keys, newer)
        assert await rank_0.client.get(rank_0.keys.rendezvous(JOB)) is None
    finally:
        await asyncio.to_thread(leader.close, 2.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_fsdp_rank_members_match_a_single_rank_hold_half_and_each_serve_their_share(
    rank_0: ServiceRuntime,
    trainer_1: MemberRecord,
    fast_monitor: ServiceRuntime,
    model_dir: Path,
) -> None:
    """Two FSDP2 ranks, rank 1 a trainer service process of its own: after 3 steps on the
    same batches the summed loss and the gradient norm match a single rank's within 1e-4, and
    each rank holds about half of the parameters and of Adam's moments, as each reports in
    its beats (`held_*`). Each version is published from the shards, as the worker does:
    rank 0 writes the manifest and serves its buckets, rank 1 serves the others from its own
    process; a rollout's pull takes each range from the rank that holds it, and the weights
    it gets match the single rank's within 1e-5."""
    spec = JobSpec(
        name="ranks",
        model=ModelSpec(path=str(model_dir)),
        trainer=TrainerSpec(world_size=2, strategy="fsdp", weight_bucket_mib=1),
    )
    assert rank_0.client is not None
    transport = await make_transport(
        "ucx",
        rank_0.client,
        rank_0.keys,
        JOB,
        instance_id="trainer-0",
        epoch=1,
        bucket_bytes=1 << 20,
    )
    rollout = UcxTransport(rank_0.client, rank_0.keys, JOB, instance_id="rollout-0", relay=False)
    await rollout.start()
    shares = share_settings(spec, transport, torch.device("cpu"))
    trainer, leader = await _form_group(rank_0, trainer_1, spec, shares=shares)
    single = await asyncio.to_thread(_load, spec)

    async def publish(version: int) -> None:
        assert leader.share is not None
        await publish_share(
            transport, leader.share, version, on_nonfinite=print, on_wait=lambda: None
        )

    try:
        await publish(0)
        for step in range(3):
            batch = _batch(single, step)
            got = await asyncio.to_thread(leader.step, trainer, batch, step=step)
            want = single.step(batch)
            assert got.stepped and want.stepped
            assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6), step
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4), step
            await publish(step + 1)

        # The model is 1.1 MiB: two buckets of 1 MiB, the first rank 0's, the second rank 1's.
        assert leader.share is not None
        assert (leader.share.share.first, leader.share.share.stop) == (0, 1)
        pulled = dict(await rollout.pull(JOB, 3))
        for name, value in single.model.state_dict().items():
            assert torch.allclose(pulled[name], value, atol=1e-5, rtol=0), name
        assert dict(rollout.counters.buckets_by_source) == {"trainer-0": 1, "trainer-1": 1}

        total = sum(p.numel() for p in single.model.parameters())
        rank1: list[monitor_pb2.MemberHealth] = []

        async def rank_1_beat_step_3() -> bool:
            rank1[:] = [(await _health(fast_monitor))[RANK_1]]
            return rank1[0].counters["step"] == 3

        await eventually(rank_1_beat_step_3, timeout=10)
        held = [dict(rank_0.progress.counters), dict(rank1[0].counters)]
        assert held[0]["held_params"] + held[1]["held_params"] == total
        for counters in held:
            assert abs(counters["held_params"] - total / 2) <= total * 0.05, counters
            # Adam's two moments of its half.
            assert abs(counters["held_optimizer"] - total) <= total * 0.1, counters
    finally:
        await asyncio.to_thread(leader.close, 2.0)
        await rollout.close()
        await transport.close()
