"""The rollout's probe and progress counters, against real servers: a real etcd, coordinator,
monitor, trainer and rollout on free ports, and a real job bound through the coordinator.

The rollout's generation is a real TorchEngine whose model forward the test can pace, hold
on a threading.Event (a hung engine, from the event loop's point of view) or turn non-finite.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from robustrl.contracts import packed
from robustrl.contracts.ledger import WorkLedger
from robustrl.core.config import EtcdSettings
from robustrl.core.runtime import ServiceRuntime
from robustrl.generation.engine import TorchEngine
from robustrl.generation.modelgen import ModelShape, init_model
from robustrl.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
)
from services.rollout.config import RolloutSettings
from services.rollout.gauges import RATE_WINDOW_S, GenerationMeter
from services.rollout.server import RolloutServicer
from services.rollout.server import start as start_rollout
from services.rollout.worker import RolloutWorker
from services.trainer.config import TrainerSettings
from services.trainer.server import serve as serve_trainer
from tests.support import eventually

# Room for long-tail generations: 7-token prompts plus 2 x 20 new tokens.
SHAPE = ModelShape(
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=64,
)

# Every group is a long-tail one (40 decode steps), so a generation lasts long enough to
# be probed in the middle of.
SPEC = """
name: probe
trainer: {steps: 1000, groups_per_step: 4, eval_every: 1000, weight_transport: grpc}
rollout:
  replicas: 1
  group_size: 2
  max_new_tokens: 2
  long_tail_every: 1
  long_tail_factor: 20
"""


class Forward:
    """Wraps a model's forward: paced, held (a hung engine), or producing NaN logits."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.running = threading.Event()
        self.running.set()
        """Cleared: the next generation is held at its start (the prompt's forward), so a
        whole generation is left to run once it is set again."""
        self.held = threading.Event()
        """Set while a call is held."""
        self.pace = 0.0
        self.nan = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The prompt's forward is the one without a KV cache (engine.cache_keyword).
        starts_a_generation = kwargs.get("cache", kwargs.get("past_key_values")) is None
        if starts_a_generation and not self.running.is_set():
            self.held.set()
            self.running.wait(60)
            self.held.clear()
        if self.pace:
            time.sleep(self.pace)
        out = self.forward(*args, **kwargs)
        if self.nan:
            out.logits = torch.full_like(out.logits, math.nan)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return init_model(tmp_path_factory.mktemp("model"), seed=0, shape=SHAPE)


@pytest.fixture
async def rollout(etcd_settings: EtcdSettings) -> AsyncIterator[RolloutServicer]:
    servicer = await start_rollout(
        RolloutSettings(instance_id="rollout-0", heartbeat_interval=0.2), etcd_settings
    )
    yield servicer
    await servicer.runtime.shutdown()


async def probe(
    servicer: RolloutServicer, wait_s: float, timeout: float = 30
) -> rollout_pb2.ProbeResponse:
    async with grpc.aio.insecure_channel(servicer.runtime.address) as channel:
        reply: rollout_pb2.ProbeResponse = await rollout_pb2_grpc.RolloutStub(channel).Probe(
            rollout_pb2.ProbeRequest(wait_s=wait_s), timeout=timeout
        )
        return reply


async def metrics(servicer: RolloutServicer, timeout: float = 5) -> dict[str, float]:
    async with grpc.aio.insecure_channel(servicer.runtime.address) as channel:
        status = await rollout_pb2_grpc.RolloutStub(channel).GetStatus(
            trainer_pb2.GetStatusRequest(), timeout=timeout
        )
        return dict(status.metrics)


@contextlib.asynccontextmanager
async def submitted(
    etcd_settings: EtcdSettings,
    coordinator: ServiceRuntime,
    model_dir: Path,
    tmp_path: Path,
    job_id: str,
) -> AsyncIterator[tuple[coordinator_pb2_grpc.CoordinatorStub, coordinator_pb2.Job]]:
    """A trainer serving and SPEC submitted as job_id (the rollout fixture gets bound to it)."""
    trainer = await serve_trainer(
        TrainerSettings(
            instance_id="trainer-0", heartbeat_interval=0.2, runs_dir=str(tmp_path / "runs")
        ),
        etcd_settings,
    )
    try:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            api = coordinator_pb2_grpc.CoordinatorStub(channel)
            job = await api.SubmitJob(
                coordinator_pb2.SubmitJobRequest(
                    spec=SPEC, overrides=[f"model.path={model_dir}"], job_id=job_id
                ),
                timeout=5,
            )
            yield api, job
    finally:
        await trainer.shutdown()


def test_the_counters_of_a_generation_and_of_its_absence() -> None:
    counters: dict[str, float] = {"tokens_generated": 100.0}  # from an earlier job
    meter = GenerationMeter(counters)
    with meter.generating(3):
        start = meter.in_flight_since
        meter.refresh(start)
        assert counters["requests_in_flight"] == 3
        for _ in range(10):
            meter.on_tokens(6)
        meter.refresh(start + 2.0)
        assert counters["tokens_generated"] == 160  # never goes down for a new job
        assert counters["tokens_per_s"] == pytest.approx(60 / 2.0)
        assert counters["oldest_request_age_s"] == pytest.approx(2.0)
        meter.refresh(start + 4.0)  # the engine stopped: the rate falls, the age grows
        assert counters["tokens_per_s"] == pytest.approx(60 / 4.0)
        assert counters["oldest_request_age_s"] == pytest.approx(4.0)
    meter.refresh(start + 4.0 + RATE_WINDOW_S)
    assert counters["tokens_per_s"] == 0
    assert counters["requests_in_flight"] == counters["oldest_request_age_s"] == 0
    meter.count_nonfinite(2)
    meter.count_nonfinite(1)
    assert counters["nonfinite_logprobs"] == 3


async def test_the_probe_waits_on_a_weight_update_as_on_a_generation() -> None:
    meter = GenerationMeter({})
    assert (await meter.probe(0.1)).progressing  # nothing asked of the engine

    with meter.updating():
        assert meter.counters["weight_updates_in_flight"] == 1
        stuck = await meter.probe(0.2)
        assert not stuck.progressing and "weight update in the engine unfinished" in stuck.detail

        waiting = asyncio.create_task(meter.probe(30))

        async def probe_waits() -> bool:
            return meter.probes_waiting > 0

        await eventually(probe_waits, timeout=5)
    finished = await asyncio.wait_for(waiting, 5)  # the update's end answers the probe
    assert finished.progressing and "weight update in flight finished" in finished.detail
    assert meter.counters["weight_updates_in_flight"] == 0


async def test_an_unbound_rollout_is_never_hung_and_wait_s_is_bounded(
    rollout: RolloutServicer,
) -> None:
    # Idle answers at once: well inside a deadline far shorter than the wait asked for.
    reply = await probe(rollout, wait_s=30, timeout=5)
    assert reply.progressing and reply.requests_in_flight == 0
    assert "no job" in reply.detail

    for bad in (0.0, -1.0, 60.5, math.nan):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await probe(rollout, wait_s=bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "wait_s" in (info.value.details() or "")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_probe_tells_a_streaming_generation_from_a_stuck_one(
    etcd_settings: EtcdSettings,
    coordinators: list[ServiceRuntime],
    rollout: RolloutServicer,
    model_dir: Path,
    tmp_path: Path,
) -> None:
    forward: Forward | None = None
    try:
        async with submitted(etcd_settings, coordinators[0], model_dir, tmp_path, "probe") as (
            api,
            job,
        ):

            async def bound() -> bool:
                return isinstance(rollout.worker, RolloutWorker)

            await eventually(bound, timeout=30)
            worker = rollout.worker
            assert isinstance(worker, RolloutWorker) and isinstance(worker.engine, TorchEngine)
            model = worker.engine.model
            forward = Forward(model.forward)
            forward.pace = 0.01  # 40 decode steps: about half a second per generation
            model.forward = forward

            # Held inside a generation: requests in flight, tokens not moving.
            forward.running.clear()

            async def held() -> bool:
                return forward is not None and forward.held.is_set()

            await eventually(held, timeout=60)
            seen = await metrics(rollout)
            assert seen["requests_in_flight"] > 0

            async def aging() -> bool:
                return (await metrics(rollout))["oldest_request_age_s"] >= 0.5

            await eventually(aging, timeout=10)  # refreshed although the engine is stuck

            # The probe waits on the event loop, which keeps serving meanwhile.
            waiting = asyncio.create_task(probe(rollout, wait_s=2.0))
            await metrics(rollout, timeout=1.0)
            assert not waiting.done()
            stuck = await waiting
            assert not stuck.progressing
            assert stuck.requests_in_flight == seen["requests_in_flight"]
            # It waited its 2 s (more where the loop was busy: the probe's own clock counts).
            quiet = re.search(r"no new token in (\d+\.\d)s", stuck.detail)
            assert quiet is not None and float(quiet.group(1)) >= 2.0, stuck.detail

            # Released while a probe waits: it answers progressing, mid-generation.
            waiting = asyncio.create_task(probe(rollout, wait_s=30))

            async def probe_waits() -> bool:
                return worker.meter.probes_waiting > 0

            await eventually(probe_waits, timeout=5)
            forward.running.set()
            streaming = await waiting
            assert streaming.progressing, streaming.detail
            assert "new tokens in" in streaming.detail, streaming.detail
            # Counted per decode step: more tokens while the same generation still runs.
            assert streaming.requests_in_flight > 0
            assert streaming.tokens_generated > stuck.tokens_generated

            # Non-finite logprobs: counted, and the group never reaches the trainer.
            forward.nan = True

            async def counted() -> bool:
                return (await metrics(rollout)).get("nonfinite_logprobs", 0.0) > 0

            await eventually(counted, timeout=30)
            for trajectory in worker.stream.unsettled.values():
                assert all(math.isfinite(lp) for lp in trajectory.logprobs)

            # ... and it is given back, to be leased again at once (not at lease expiry).
            async def given_back() -> bool:
                raw = await coordinators[0].client.get(coordinators[0].keys.work("probe"))  # type: ignore[union-attr]
                released = packed.load(WorkLedger, raw.value).released if raw else {}
                return any("non-finite logprobs" in why for w in released.values() for why in w)

            await eventually(given_back, timeout=30)
            got = await api.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
            assert got.phase == coordinator_pb2.JOB_PHASE_RUNNING, got.message

            # Waiting with nothing to generate is idle, not a hang.
            forward.nan = False
            await api.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)

            async def released() -> bool:
                return rollout.worker is None

            await eventually(released, timeout=30)
            idle = await probe(rollout, wait_s=30, timeout=5)
            assert idle.progressing and idle.requests_in_flight == 0
            assert (await metrics(rollout))["requests_in_flight"] == 0
    finally:
        if forward is not None:
            forward.running.set()  # never leave the generation thread held


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_trajectory_stream_ended_by_its_own_error_opens_again_and_delivers(
    etcd_settings: EtcdSettings,
    coordinators: list[ServiceRuntime],
    rollout: RolloutServicer,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with submitted(etcd_settings, coordinators[0], model_dir, tmp_path, "stream") as (
        api,
        job,
    ):

        async def step() -> int:
            got = await api.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
            return int(got.step)

        async def training() -> bool:
            return await step() >= 1

        await eventually(training, timeout=60)
        worker = rollout.worker
        assert isinstance(worker, RolloutWorker)

        # The writer's next take from the outbox fails with an error that is not gRPC's
        # (a bug), while the trainer keeps the stream open and answering.
        take = worker.stream.outbox.get
        failed = False

        async def failing_take() -> list[trainer_pb2.Trajectory]:
            nonlocal failed
            if not failed:
                failed = True
                raise RuntimeError("injected: the trajectory writer fails")
            return await take()

        monkeypatch.setattr(worker.stream.outbox, "get", failing_take)

        async def counted() -> bool:
            return (await metrics(rollout)).get("stream_failures", 0.0) == 1

        await eventually(counted, timeout=30)
        # Trajectories reach the trainer again: steps go on being trained.
        after = await step()

        async def trained_on() -> bool:
            return await step() >= after + 2

        await eventually(trained_on, timeout=60)
        assert (await metrics(rollout))["stream_failures"] == 1
        await api.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_generate_loop_ended_by_an_unhandled_error_crashes_the_rollout(
    etcd_settings: EtcdSettings,
    coordinators: list[ServiceRuntime],
    rollout: RolloutServicer,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left alone, a generate loop that died of a bug would leave a rollout that beats and
    answers probes (idle) but never generates again, holding its leased groups. It crashes
    instead (no goodbye), so that it is reported lost and replaced; here `crash` is recorded
    rather than ending the test's own process."""
    crashes: list[str] = []
    monkeypatch.setattr(rollout.runtime, "crash", crashes.append)
    async with submitted(etcd_settings, coordinators[0], model_dir, tmp_path, "crash") as (
        api,
        job,
    ):

        async def training() -> bool:
            got = await api.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
            return got.step >= 1

        await eventually(training, timeout=60)
        worker = rollout.worker
        assert isinstance(worker, RolloutWorker) and worker.engine is not None

        def failing_generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: the engine fails")

        monkeypatch.setattr(worker.engine, "generate", failing_generate)

        async def crashed() -> bool:
            return bool(crashes)

        await eventually(crashed, timeout=30)
        [reason] = crashes
        assert reason.startswith("generate-crash failed") and "injected" in reason
        await api.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
        with contextlib.suppress(RuntimeError):  # the failed loop's error, raised on stop
            await rollout.stop_worker()
