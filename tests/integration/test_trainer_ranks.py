"""Two trainer ranks on gloo: rank 0 in this process (as the trainer worker runs it), rank 1 a
real follower process. Both register in a real etcd and beat to a real monitor. They train
alike, and when rank 1 is stopped (SIGSTOP) inside a step, the incident names rank 1 within
the collective budget."""

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

from robustrl.contracts.jobspec import JobSpec, ModelSpec
from robustrl.core.config import EtcdSettings
from robustrl.core.heartbeat import Progress
from robustrl.core.incident_log import IncidentLog
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import monitor_pb2, monitor_pb2_grpc
from services.monitor import progress_detectors
from services.monitor.config import MonitorSettings
from services.monitor.server import serve as serve_monitor
from services.trainer.config import TrainerSettings
from services.trainer.follower import EXIT_FAILED, load_model, make_trainer
from services.trainer.grpo import GRPOTrainer, Sample, StepMetrics, completion_logprobs
from services.trainer.ranks import LeaderRanks, RankExited, fingerprint
from services.trainer.worker import JOB_ERRORS
from tests.support import eventually, process_state

JOB = "ranks-job"
BUDGET = 1.0
"""The monitor's collective budget here: the incident must come within it (plus a round)."""
STOP_AT = 3
"""The 1-based step inside which rank 1 is stopped."""


@pytest.fixture
async def fast_monitor(etcd_settings: EtcdSettings) -> AsyncIterator[ServiceRuntime]:
    runtime = await serve_monitor(
        MonitorSettings(instance_id="monitor-0", collective_budget=BUDGET), etcd_settings
    )
    yield runtime
    await runtime.shutdown()


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


async def _health(monitor: ServiceRuntime) -> dict[str, monitor_pb2.MemberHealth]:
    async with grpc.aio.insecure_channel(monitor.address) as channel:
        reply = await monitor_pb2_grpc.MonitorStub(channel).GetHealth(
            monitor_pb2.GetHealthRequest(job_id=JOB), timeout=5
        )
    return {m.instance_id: m for m in reply.members}


RankZero = tuple[ServiceRuntime, GRPOTrainer, LeaderRanks, Path]


async def _rank_0(etcd_settings: EtcdSettings, model_dir: Path, tmp_path: Path) -> RankZero:
    """Rank 0 as the trainer worker runs it: its runtime (registered, bound to JOB, beating
    every 0.1 s), its model, its LeaderRanks, and the spec file the followers load."""
    spec = JobSpec(name="ranks", model=ModelSpec(path=str(model_dir)))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    settings = TrainerSettings(instance_id="trainer-0", heartbeat_interval=0.1)
    runtime = ServiceRuntime("trainer", settings, etcd_settings, service_names=[])
    await runtime.start()
    runtime.progress.job_id = JOB
    await runtime.update_member(job_id=JOB)
    return (
        runtime,
        make_trainer(spec, 0, *load_model(spec, 0)),
        LeaderRanks(runtime.progress, timeout_s=60),
        spec_path,
    )


async def _start_rank_1(rank_0: RankZero, etcd_settings: EtcdSettings, *args: str) -> None:
    """Start rank 1 (a real follower process, with `args` for failure injection) and form
    the group."""
    runtime, trainer, leader, spec_path = rank_0
    await asyncio.to_thread(
        leader.start,
        trainer,
        spec_path=spec_path,
        job_id=JOB,
        world_size=2,
        etcd=etcd_settings,
        instance_id=runtime.instance_id,
        settings=runtime.settings,
        follower_args={1: list(args)},
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_ranks_train_alike_and_a_rank_stopped_in_a_step_is_named(
    etcd_settings: EtcdSettings, fast_monitor: ServiceRuntime, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rank_0 = await _rank_0(etcd_settings, tiny_model_dir, tmp_path)
    runtime, trainer, leader, _ = rank_0
    stepping: asyncio.Task[StepMetrics] | None = None
    follower_pid = 0
    try:
        await _start_rank_1(rank_0, etcd_settings, f"--stop-at-step={STOP_AT}")
        [follower] = leader.procs
        follower_pid = follower.pid
        assert runtime.registry is not None
        member = await runtime.registry.get("trainer", "trainer-0-rank1")
        assert member is not None and member.pid == follower.pid
        assert member.job_id == JOB  # never taken for a free trainer
        assert member.labels == {"rank": "1", "follower": "true"}

        # A few steps: the ranks' parameters stay identical (rank 0 checks every step).
        for step in range(STOP_AT - 1):
            metrics = await asyncio.to_thread(
                leader.step, trainer, _batch(trainer, step), step=step
            )
            assert metrics.stepped and metrics.num_samples == 4 and metrics.num_tokens == 8
            assert leader.fingerprints[0] == leader.fingerprints[1] == fingerprint(trainer.model)

        async def follower_caught_up() -> bool:
            rank1 = (await _health(fast_monitor)).get("trainer-0-rank1")
            return rank1 is not None and rank1.counters["step"] == STOP_AT - 1

        await eventually(follower_caught_up, timeout=10)

        # Step STOP_AT: rank 1 stops itself (SIGSTOP) in forward_backward; rank 0 goes on to
        # the gradient sum and waits there.
        batch = _batch(trainer, STOP_AT - 1)
        stepping = asyncio.create_task(
            asyncio.to_thread(leader.step, trainer, batch, step=STOP_AT - 1)
        )

        async def rank1_stopped() -> bool:
            return process_state(follower.pid) in ("T", "t")

        await eventually(rank1_stopped, timeout=10)
        stopped_at = time.time()

        assert fast_monitor.client is not None
        log = IncidentLog(fast_monitor.client, fast_monitor.keys)

        async def collective_hang_reported() -> bool:
            incidents, _ = await log.list(JOB)
            return any(i.kind == "COLLECTIVE_HANG" for i in incidents)

        await eventually(collective_hang_reported, timeout=BUDGET + 10)
        incidents, _ = await log.list(JOB)
        [hang] = [i for i in incidents if i.kind == "COLLECTIVE_HANG"]
        assert (hang.instance_id, hang.rank) == ("trainer-0-rank1", 1)
        assert "rank 1 has not entered it" in hang.evidence
        # Named within the budget of rank 0's wait, give or take a beat and a monitor round.
        waited_from = runtime.progress.phase_started_at
        assert runtime.progress.phase == "collective"
        assert BUDGET < hang.detected_at - waited_from < BUDGET + 1.5
        assert hang.detected_at - stopped_at < BUDGET + 5.0

        # What the monitor saw, fed to the pure detector: rank 0 waits in a collective that
        # rank 1 never entered.
        health = await _health(fast_monitor)
        rank0, rank1 = health["trainer-0"], health["trainer-0-rank1"]
        assert rank0.phase == "collective"
        assert rank0.counters["collective_seq"] > rank1.counters["collective_seq"]
        signals = [
            progress_detectors.Signals(
                role="trainer",
                instance_id=m.instance_id,
                job_id=JOB,
                rank=rank,
                phase=m.phase,
                phase_started_at=started,
                counters=dict(m.counters),
            )
            for m, rank, started in (
                (rank0, 0, runtime.progress.phase_started_at),
                (rank1, 1, 0.0),
            )
        ]
        [finding] = progress_detectors.collective_hangs(
            signals, time.time(), progress_detectors.ProgressConfig(collective_budget=BUDGET)
        )
        assert (finding.instance_id, finding.rank) == ("trainer-0-rank1", 1)

        # Let it go: the step completes on both ranks, and they still agree.
        follower.send_signal(signal.SIGCONT)
        metrics = await asyncio.wait_for(stepping, 30)
        stepping = None
        assert metrics.stepped and metrics.num_samples == 4
        assert leader.fingerprints[0] == leader.fingerprints[1]
        assert await asyncio.to_thread(leader.close) == [0]

        async def follower_left() -> bool:
            gone = (await _health(fast_monitor))["trainer-0-rank1"].state == "GONE"
            assert runtime.registry is not None
            return gone and await runtime.registry.get("trainer", "trainer-0-rank1") is None

        await eventually(follower_left, timeout=10)
    finally:
        if follower_pid and leader.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower_pid, signal.SIGCONT)
        if stepping is not None:
            for proc in leader.procs:
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stepping, 30)
        await asyncio.to_thread(leader.close, 2.0)
        await runtime.shutdown()


async def test_a_follower_that_dies_before_joining_fails_the_start_at_once(
    etcd_settings: EtcdSettings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = JobSpec(name="ranks", model=ModelSpec(path=str(tiny_model_dir)))
    trainer = make_trainer(spec, 0, *load_model(spec, 0))
    progress = Progress(phase="loading")
    leader = LeaderRanks(progress, timeout_s=60)
    started = time.monotonic()
    with pytest.raises(RankExited, match="rank 1 exited with code 1 before joining"):
        await asyncio.to_thread(
            leader.start,
            trainer,
            spec_path=tmp_path / "no-such-spec.json",
            job_id=JOB,
            world_size=2,
            etcd=etcd_settings,
            instance_id="trainer-0",
        )
    assert time.monotonic() - started < 30  # not the 60 s join timeout
    assert progress.phase == "loading" and "collective_seq" not in progress.counters
    assert await asyncio.to_thread(leader.close) == []


@pytest.mark.timeout(120)
async def test_a_follower_that_fails_in_a_step_fails_rank_0s_step_at_once(
    etcd_settings: EtcdSettings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 raises inside step 2 (as a device error would): it logs why and exits, and rank
    0's step fails as soon as rank 1's connections close, not at the 60 s collective timeout,
    with an error that names rank 1 (gloo's own says only that a connection broke). It is the
    trainer's machine failing, not the job's: the coordinator recovers the trainer elsewhere."""
    rank_0 = await _rank_0(etcd_settings, tiny_model_dir, tmp_path)
    runtime, trainer, leader, _ = rank_0
    try:
        await _start_rank_1(rank_0, etcd_settings, "--fail-at-step=2")
        [follower] = leader.procs
        first = await asyncio.to_thread(leader.step, trainer, _batch(trainer, 0), step=0)
        assert first.stepped
        before = fingerprint(trainer.model)

        started = time.monotonic()
        with pytest.raises(
            RankExited, match=r"in step 2: trainer rank 1 exited with code 1 \("
        ) as raised:
            await asyncio.to_thread(leader.step, trainer, _batch(trainer, 1), step=1)
        took = time.monotonic() - started
        assert took < 15, f"rank 0 learnt of rank 1's failure after {took:.1f}s"
        assert not isinstance(raised.value, JOB_ERRORS)
        assert await asyncio.to_thread(follower.wait, 10) == EXIT_FAILED
        # The failed step changed nothing on rank 0: no optimizer step without rank 1's part.
        assert fingerprint(trainer.model) == before

        closing = time.monotonic()
        assert await asyncio.to_thread(leader.close) == [EXIT_FAILED]
        assert time.monotonic() - closing < 5  # the broken group is not asked to stop again
        assert runtime.registry is not None

        async def follower_deregistered() -> bool:
            assert runtime.registry is not None
            return await runtime.registry.get("trainer", "trainer-0-rank1") is None

        await eventually(follower_deregistered, timeout=10)
    finally:
        for proc in leader.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await asyncio.to_thread(leader.close, 2.0)
        await runtime.shutdown()
