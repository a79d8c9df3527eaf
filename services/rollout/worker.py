"""One job on a rollout: lease prompt groups, generate and score them, stream the
trajectories to the trainer, keep every trajectory until the trainer commits or rejects it.

Trajectory ids are `<group id>/<index>`: stable for a group whoever generates it, so a group
leased again after a failure de-duplicates at the trainer. Generation runs in a worker
thread; the event loop keeps the trajectory stream, heartbeats and weight pulls going.

What the monitor reads in the beats (kept by `GenerationMeter`):
- `tokens_generated`: tokens sampled by this process, counted after every decode step from
  the generation thread, so a long generation keeps it growing;
- `requests_in_flight`: prompts inside the engine now; 0 while leasing, waiting for weights,
  scoring or delivering (none of that is generation, so none of it can be a generation hang);
- `oldest_request_age_s`: seconds the oldest of them has been in the engine (0 when none);
- `tokens_per_s`: tokens over the last `RATE_WINDOW_S` seconds;
- `nonfinite_logprobs`: NaN/Inf logprobs of sampled tokens seen by this process. A group with
  one is never sent to the trainer and is not completed: its lease runs out and the
  coordinator leases it again.

With `rollout.long_tail_every` N > 0, every Nth group of the job (by group index, so the same
group whoever generates it) is generated with exactly `max_new_tokens * long_tail_factor`
tokens, to show that a long generation is not taken for a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from robustrl.contracts.errors import InvalidArgument, Unavailable
from robustrl.contracts.ids import group_index
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.aio import cancel_and_wait
from robustrl.core.channels import open_channel
from robustrl.core.coordinator_client import NO_LEADER_ANSWER, CoordinatorClient
from robustrl.core.etcd_client import etcd_unavailable, until_etcd_answers
from robustrl.core.interceptors import REPEAT_WINDOW_S, Repeats
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime, long_lived_objects
from robustrl.generation.engine import ContextExceeded, SamplingParams, TorchEngine
from robustrl.generation.rewards import RewardError, RewardFn, load_reward, score
from robustrl.v1 import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from robustrl.weights import (
    WeightIntegrityError,
    WeightTransport,
    latest_announcement,
    make_transport,
)
from services.rollout.config import RolloutSettings

log = get_logger(__name__)

RPC_DEADLINE = 10.0
RESEND_BATCH = 256
"""Trajectories per message when re-sending after a reconnect."""

RATE_WINDOW_S = 5.0
"""Span of the recent token rate (`tokens_per_s`)."""

GAUGE_INTERVAL_S = 0.25
"""How often the gauges that change with time alone (request age, token rate) and the weight
transport's (a pull's progress, what was relayed) are refreshed: a hung generation thread cannot
refresh them."""

RETRIED_CODES = NO_LEADER_ANSWER | {grpc.StatusCode.ABORTED}
"""Coordinator answers a completion is sent again after: no leader, none in time, or the job
changed under it (it says to retry)."""


class JobError(Exception):
    """This rollout cannot do the job's work; the coordinator fails the job with the message."""


@dataclass(frozen=True)
class ProbeResult:
    progressing: bool
    requests_in_flight: int
    tokens_generated: float
    detail: str


class GenerationMeter:
    """The rollout's progress counters (see the module docstring) and the probe over them.

    `on_tokens` runs on the generation thread; everything else on the event loop. Every key
    exists before the thread writes, so a beat copying the counters never sees the dict
    change size; a float store is atomic under the GIL. The cumulative counters carry on
    from what this process already reported, so they never go down when a new job binds.
    """

    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters
        for name in ("tokens_generated", "nonfinite_logprobs"):
            counters.setdefault(name, 0.0)
        for name in ("requests_in_flight", "oldest_request_age_s", "tokens_per_s"):
            counters[name] = 0.0
        self.tokens = counters["tokens_generated"]
        self.nonfinite = counters["nonfinite_logprobs"]
        self.in_flight = 0
        self.in_flight_since = 0.0
        self._samples: deque[tuple[float, float]] = deque()
        self._wakers: list[Callable[[], None]] = []

    @property
    def probes_waiting(self) -> int:
        return len(self._wakers)

    def on_tokens(self, count: int) -> None:
        """The engine sampled `count` new tokens (generation thread)."""
        self.tokens += count
        self.counters["tokens_generated"] = self.tokens
        self._wake()

    def _wake(self) -> None:
        for wake in tuple(self._wakers):
            wake()

    @contextlib.contextmanager
    def generating(self, requests: int) -> Iterator[None]:
        """`requests` prompts are inside the engine for the duration."""
        self.in_flight, self.in_flight_since = requests, time.monotonic()
        self.counters["requests_in_flight"] = float(requests)
        try:
            yield
        finally:
            self.in_flight = 0
            self.counters["requests_in_flight"] = 0.0
            self.counters["oldest_request_age_s"] = 0.0
            self._wake()

    def count_nonfinite(self, count: int) -> None:
        self.nonfinite += count
        self.counters["nonfinite_logprobs"] = self.nonfinite

    def refresh(self, now: float) -> None:
        """Update the time-driven gauges (`now`: time.monotonic())."""
        self.counters["oldest_request_age_s"] = (
            max(now - self.in_flight_since, 0.0) if self.in_flight else 0.0
        )
        samples = self._samples
        samples.append((now, self.tokens))
        while len(samples) > 1 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        then, tokens_then = samples[0]
        self.counters["tokens_per_s"] = (
            (self.tokens - tokens_then) / (now - then) if now > then else 0.0
        )

    async def probe(self, wait_s: float) -> ProbeResult:
        """Progressing unless requests are in flight and no token comes within `wait_s`."""
        if self.in_flight == 0:
            return ProbeResult(True, 0, self.tokens, "idle: no requests in flight")
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under a late thread
                loop.call_soon_threadsafe(woken.set)

        before, in_flight, started = self.tokens, self.in_flight, time.monotonic()
        self._wakers.append(wake)
        try:
            while True:
                # Cleared before the check: a token counted after the check sets it again.
                woken.clear()
                remaining = started + wait_s - time.monotonic()
                if self.tokens > before or self.in_flight == 0 or remaining <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), remaining)
        finally:
            self._wakers.remove(wake)
        took = time.monotonic() - started
        if self.tokens > before:
            return ProbeResult(
                True,
                self.in_flight,
                self.tokens,
                f"{self.tokens - before:.0f} new tokens in {took:.2f}s "
                f"with {in_flight} requests in flight",
            )
        if self.in_flight == 0:
            return ProbeResult(True, 0, self.tokens, "the generation in flight finished")
        return ProbeResult(
            False,
            self.in_flight,
            self.tokens,
            f"no new token in {took:.1f}s with {self.in_flight} requests in flight for "
            f"{time.monotonic() - self.in_flight_since:.1f}s "
            f"({self.tokens:.0f} tokens generated before)",
        )


@dataclass
class Generated:
    """One lease's generation: what goes to the trainer, and the groups it covers."""

    trajectories: list[trainer_pb2.Trajectory] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    """Groups whose trajectories are all in `trajectories` (dropped ones are not)."""
    returned: dict[str, str] = field(default_factory=dict)
    """Groups given back to the coordinator unfinished, with why."""


class RolloutWorker:
    def __init__(
        self,
        runtime: ServiceRuntime,
        settings: RolloutSettings,
        *,
        job_id: str,
        epoch: int,
        spec: JobSpec,
    ) -> None:
        self.runtime = runtime
        self.settings = settings
        self.job_id = job_id
        self.epoch = epoch
        self.spec = spec
        self.engine: TorchEngine | None = None
        self.reward: RewardFn | None = None
        self.transport: WeightTransport | None = None
        # Trajectories the trainer has not committed or rejected yet, by id.
        self.unsettled: dict[str, trainer_pb2.Trajectory] = {}
        self.received: set[str] = set()
        self.acked = asyncio.Event()
        self.outbox: asyncio.Queue[list[trainer_pb2.Trajectory]] = asyncio.Queue()
        self.meter = GenerationMeter(runtime.progress.counters)
        self.loaded_epoch = 0  # trainer epoch of the weights in the engine (0: from disk)
        self._tasks: list[asyncio.Task[None]] = []
        assert runtime.client is not None
        self.coordinator = CoordinatorClient(runtime.client, runtime.keys)

    def load(self) -> None:
        """All of a rollout's set-up is `prepare`: weights are pulled after it starts."""
        self.prepare()

    def prepare(self) -> None:
        """Build the engine and the reward; done once, a second call returns at once."""
        if self.engine is not None:
            return
        torch.set_num_threads(self.settings.torch_threads)
        path = Path(self.spec.model.path)
        if not (path / "config.json").exists():
            raise InvalidArgument(
                f"model.path: no model at {path} (run `robustrl model init` to create the tiny one)"
            )
        try:
            self.reward = load_reward(self.spec.task.reward)
        except RewardError as exc:
            raise InvalidArgument(f"task.reward: {exc}") from exc
        with long_lived_objects():
            self.engine = TorchEngine.from_pretrained(str(path))
        rollout = self.spec.rollout
        longest = rollout.max_new_tokens * rollout.long_tail_factor
        if rollout.long_tail_every and longest >= self.engine.max_positions:
            raise InvalidArgument(
                f"rollout.long_tail_factor: a long-tail group generates max_new_tokens * "
                f"long_tail_factor = {longest} tokens, more than the model's context of "
                f"{self.engine.max_positions} positions leaves room for after a prompt"
            )

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._generate_loop(), name=f"generate-{self.job_id}"),
            asyncio.create_task(self._stream_loop(), name=f"stream-{self.job_id}"),
            asyncio.create_task(self._gauge_loop(), name=f"gauges-{self.job_id}"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A loop that ends with an error this rollout does not handle (a bug) crashes the
        process. Left alone, the rollout would look alive while it no longer generates, or
        holds trajectories it never sends: its leased groups would wait on it for good."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("rollout.worker_failed", task=task.get_name(), exc_info=task.exception())
        self.runtime.crash(f"{task.get_name()} failed: {task.exception()!r}")

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self.transport is not None:
            await self.transport.close()
        await self.coordinator.close_channels()

    # ------------------------------------------------------------------ generation

    async def _generate_loop(self) -> None:
        progress = self.runtime.progress
        assert self.runtime.client is not None
        # Pulled versions are kept and served to peers (relay), so a new or recovered rollout
        # does not have to go to the trainer for them.
        client = self.runtime.client
        self.transport = await until_etcd_answers(
            lambda: make_transport(
                self.spec.trainer.weight_transport,
                client,
                self.runtime.keys,
                self.job_id,
                instance_id=self.runtime.instance_id,
                host=self.runtime.settings.resolved_advertise_host(),
                session_ttl=self.runtime.etcd_settings.session_ttl,
                keep_versions=1,  # one staging copy: the relayed version goes at the next pull
            ),
            "starting the weight transport",
        )
        lease_failures = Repeats(REPEAT_WINDOW_S)
        request_id = ""
        while True:
            # One id per ask, kept while it goes unanswered: a leader that stored the lease and
            # died before answering leaves its groups to this rollout, and its successor answers
            # the retry with them (else they wait out their lease, and fill the job's budget).
            request_id = request_id or uuid.uuid4().hex
            request = coordinator_pb2.LeaseWorkRequest(
                job_id=self.job_id,
                instance_id=self.runtime.instance_id,
                epoch=self.epoch,
                max_groups=self.settings.groups_per_lease,
                request_id=request_id,
            )
            try:
                reply = await self._lease(request)
                request_id = ""
            except (grpc.aio.AioRpcError, Unavailable) as exc:
                # Equal failures once per window: an outage fails every ask twice a second.
                error = (
                    f"{exc.code().name}: {exc.details()}"
                    if isinstance(exc, grpc.aio.AioRpcError)
                    else str(exc)
                )[:200]
                unlogged = lease_failures.admit((error,))
                if unlogged is not None:
                    log.info("rollout.lease_failed", error=error, unlogged=unlogged)
                await asyncio.sleep(0.5)
                continue
            if reply.job_done:
                progress.phase = "idle"
                return
            if not reply.groups:
                progress.phase = "waiting"
                await asyncio.sleep(max(reply.retry_after_s, 0.05))
                continue
            try:
                await self._ensure_weights(reply.min_weight_version)
                progress.phase = "generating"
                generated_from = time.time()
                generated = await self._generate(list(reply.groups))
                generated_to = time.time()
            except JobError as exc:
                log.error("rollout.job_error", job=self.job_id, error=str(exc))
                await self._complete([], error=str(exc))
                return
            trajectories = generated.trajectories
            for traj in trajectories:
                self.unsettled[traj.trajectory_id] = traj
            self.outbox.put_nowait(trajectories)
            progress.phase = "delivering"
            await self._wait_received([t.trajectory_id for t in trajectories])
            if generated.group_ids or generated.returned:
                await self._complete(
                    generated.group_ids,
                    returned=generated.returned,
                    span=(generated_from, generated_to),
                )

    async def _lease(
        self, request: coordinator_pb2.LeaseWorkRequest
    ) -> coordinator_pb2.LeaseWorkResponse:
        return await self.coordinator.write(lambda s: s.LeaseWork(request, timeout=RPC_DEADLINE))

    async def _gauge_loop(self) -> None:
        progress = self.runtime.progress
        while True:
            self.meter.refresh(time.monotonic())
            if self.transport is not None:  # how far a pull has come, what was relayed
                # In place, on the loop (the beats are copied there), not by set_counter: the
                # meter keeps this dict and writes into it from the generation thread.
                progress.counters.update(self.transport.gauges())
            await asyncio.sleep(GAUGE_INTERVAL_S)

    def _is_long_tail(self, group_id: str) -> bool:
        every = self.spec.rollout.long_tail_every
        return every > 0 and (group_index(group_id) + 1) % every == 0

    async def _generate(self, groups: list[coordinator_pb2.PromptGroup]) -> Generated:
        """Generate and score the groups: the normal ones in one batch, long-tail ones in
        another (a batch runs as long as its longest row)."""
        out = Generated()
        crash = self.spec.faults.crash_groups
        poison = [g.group_id for g in groups if group_index(g.group_id) in crash]
        if poison:
            self.runtime.crash(f"faults.crash_groups: generating group {poison[0]}")
        normal = [g for g in groups if not self._is_long_tail(g.group_id)]
        long_tail = [g for g in groups if self._is_long_tail(g.group_id)]
        for batch, is_long_tail in ((normal, False), (long_tail, True)):
            if batch:
                await self._generate_batch(batch, is_long_tail, out)
        return out

    async def _generate_batch(
        self, groups: list[coordinator_pb2.PromptGroup], long_tail: bool, out: Generated
    ) -> None:
        assert self.engine is not None and self.reward is not None
        spec = self.spec
        version = self.engine.weight_version
        max_new_tokens = spec.rollout.max_new_tokens
        if long_tail:
            max_new_tokens *= spec.rollout.long_tail_factor
        params = SamplingParams(
            n=groups[0].group_size,
            temperature=spec.rollout.temperature,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if long_tail else 0,
            seed=zlib.crc32(f"{spec.seed}/{groups[0].group_id}/{version}".encode()),
        )
        try:
            with self.meter.generating(len(groups)):
                outputs = await asyncio.to_thread(
                    self.engine.generate, [g.prompt for g in groups], params, self.meter.on_tokens
                )
        except ContextExceeded as exc:  # the job's input: name the row to fix
            group = groups[exc.index]
            raise JobError(
                f"cannot generate group {group.group_id} (dataset item {group.item_id!r}): {exc}"
            ) from exc
        except ValueError as exc:
            raise JobError(f"cannot generate: {exc}") from exc
        for group, completions in zip(groups, outputs, strict=True):
            nonfinite = sum(not math.isfinite(lp) for c in completions for lp in c.logprobs)
            if nonfinite:
                self.meter.count_nonfinite(nonfinite)
                log.error(
                    "rollout.group_dropped",
                    job=self.job_id,
                    group=group.group_id,
                    reason="non-finite logprobs",
                    nonfinite_logprobs=nonfinite,
                    version=version,
                    then="not sent; given back to be leased again",
                )
                out.returned[group.group_id] = f"non-finite logprobs under version {version}"
                continue
            for index, completion in enumerate(completions):
                try:
                    reward = score(self.reward, group.prompt, completion.text, group.answer)
                except RewardError as exc:
                    raise JobError(str(exc)) from exc
                out.trajectories.append(
                    trainer_pb2.Trajectory(
                        trajectory_id=f"{group.group_id}/{index}",
                        job_id=self.job_id,
                        rollout_instance_id=self.runtime.instance_id,
                        rollout_epoch=self.epoch,
                        group_id=group.group_id,
                        group_size=group.group_size,
                        weight_version=version,
                        prompt_ids=completion.prompt_ids,
                        completion_ids=completion.token_ids,
                        logprobs=completion.logprobs,
                        reward=reward,
                        finish_reason=completion.finish_reason,
                    )
                )
            out.group_ids.append(group.group_id)
        self.runtime.progress.counters["weight_version"] = float(version)

    async def _ensure_weights(self, min_version: int) -> None:
        """Load the newest announced version; wait for one >= min_version if needed."""
        assert self.engine is not None and self.runtime.client is not None
        client = self.runtime.client
        while True:
            latest = await until_etcd_answers(
                lambda: latest_announcement(client, self.runtime.keys, self.job_id),
                "looking for new weights",
            )
            if latest is not None and (
                latest.trainer_epoch > self.loaded_epoch
                or latest.version > self.engine.weight_version
            ):
                # A newer trainer epoch wins even with a lower version: a restored trainer
                # goes back to its checkpoint's step.
                assert self.transport is not None
                self.runtime.progress.enter("pulling_weights")
                try:
                    tensors = await self.transport.fetch(latest)
                except Exception as exc:
                    if not isinstance(
                        exc, WeightIntegrityError | grpc.aio.AioRpcError
                    ) and not etcd_unavailable(exc):
                        raise
                    log.warning(
                        "rollout.weights_pull_failed", version=latest.version, error=str(exc)[:200]
                    )
                    await asyncio.sleep(0.2)
                    continue
                # Swapped between generation batches: no batch ever mixes two versions.
                self.engine.load_weights(tensors, version=latest.version)
                self.loaded_epoch = latest.trainer_epoch
                log.info("rollout.weights_loaded", job=self.job_id, version=latest.version)
            if self.engine.weight_version >= min_version:
                return
            if self.runtime.progress.phase != "waiting_weights":
                self.runtime.progress.enter("waiting_weights")
            await asyncio.sleep(0.1)

    async def _wait_received(self, ids: list[str]) -> None:
        """Until the trainer has acknowledged (or settled) every one of ids."""
        while not all(i in self.received or i not in self.unsettled for i in ids):
            self.acked.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.acked.wait(), 1.0)

    async def _complete(
        self,
        group_ids: list[str],
        error: str = "",
        returned: dict[str, str] | None = None,
        span: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        request = coordinator_pb2.CompleteWorkRequest(
            job_id=self.job_id,
            instance_id=self.runtime.instance_id,
            epoch=self.epoch,
            group_ids=group_ids,
            error=error,
            returned=returned or {},
            generated_from=span[0],
            generated_to=span[1],
        )
        # Sent again for as long as no leader answers (a failover, etcd unreachable): given up,
        # the groups would stay leased to this rollout, delivered or not.
        try:
            await self.coordinator.write_until_answered(
                lambda s: s.CompleteWork(request, timeout=RPC_DEADLINE),
                retried=RETRIED_CODES,
                doing="completing work",
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            log.warning("rollout.complete_refused", code=code, error=exc.details())

    # ------------------------------------------------------------------ the stream

    async def _stream_loop(self) -> None:
        assert self.runtime.registry is not None
        registry = self.runtime.registry
        while True:
            trainers, _ = await until_etcd_answers(
                lambda: registry.list("trainer"), "looking for the trainer"
            )
            # Rank 0 only (followers serve no data plane); after a restore, the newest epoch.
            bound = sorted(
                (
                    t
                    for t in trainers
                    if t.job_id == self.job_id and t.labels.get("follower") != "true"
                ),
                key=lambda t: t.epoch,
                reverse=True,
            )
            if not bound:
                await asyncio.sleep(0.5)
                continue
            try:
                await self._stream_to(bound[0].address)
            except grpc.aio.AioRpcError as exc:
                log.info("rollout.stream_broken", code=exc.code().name, details=exc.details())
            except asyncio.InvalidStateError:
                # A write that found the call already finished ("RPC already finished"): the
                # trainer went away between two writes.
                log.info("rollout.stream_broken", code="FINISHED", details="written after end")
            except Exception:
                # Any other error is a bug, and the trajectories must still reach the trainer:
                # unhandled, it would end this loop for good while generation goes on (every
                # generated group then waits in `_wait_received` forever). Counted and logged
                # with its traceback; the stream opens again and re-sends what is unsettled.
                self.runtime.progress.counters["stream_failures"] = (
                    self.runtime.progress.counters.get("stream_failures", 0.0) + 1
                )
                log.exception("rollout.stream_failed", job=self.job_id)
            self.received.clear()
            await asyncio.sleep(0.5)

    async def _stream_to(self, address: str) -> None:
        """One stream to the trainer until either direction ends; the reader's error (the
        trainer ended the stream) or else the writer's is raised. The writer alone can fail
        while the trainer still answers: the stream is then closed rather than left to wait
        for acknowledgements of trajectories that were never sent."""
        async with open_channel(address) as channel:
            call = trainer_pb2_grpc.TrainerStub(channel).PushTrajectories()
            reader = asyncio.create_task(self._read(call), name=f"acks-{self.job_id}")
            writer = asyncio.create_task(self._write(call), name=f"writes-{self.job_id}")
            try:
                done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                call.cancel()
                for task in (reader, writer):
                    task.cancel()
                # Whatever the other direction raised while being stopped is not the cause.
                await asyncio.gather(reader, writer, return_exceptions=True)
            ended = reader if reader in done else writer
            ended.result()  # raises what ended it (the reader may end cleanly)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for ack in call:
            self.received.update(ack.received_ids)
            for tid in [*ack.committed_ids, *ack.rejected]:
                self.unsettled.pop(tid, None)
                self.received.discard(tid)
            self.acked.set()
            self.runtime.progress.counters["unsettled"] = float(len(self.unsettled))

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        # A new stream (the first, or after the trainer restarted): everything not yet
        # committed goes again, and the trainer de-duplicates by id. What is queued is
        # already in `unsettled`, so it goes out with the re-send.
        while not self.outbox.empty():
            self.outbox.get_nowait()
        pending = list(self.unsettled.values())
        for start in range(0, len(pending), RESEND_BATCH):
            await call.write(
                trainer_pb2.TrajectoryBatch(trajectories=pending[start : start + RESEND_BATCH])
            )
        while True:
            batch = [t for t in await self.outbox.get() if t.trajectory_id in self.unsettled]
            if batch:
                await call.write(trainer_pb2.TrajectoryBatch(trajectories=batch))
