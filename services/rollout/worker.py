"""One job on a rollout: lease prompt groups, generate and score them, hand the trajectories
to the trajectory stream (`stream.py`), and complete the groups with the coordinator.

Trajectory ids are `<group id>/<index>`: stable for a group whoever generates it, so a group
leased again after a failure de-duplicates at the trainer. Generation runs in a worker
thread; the event loop keeps the trajectory stream, heartbeats (`gauges.py`) and weight pulls
going.

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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from robustrl.contracts.errors import InvalidArgument, Unavailable
from robustrl.contracts.ids import group_index
from robustrl.contracts.jobspec import JobSpec
from robustrl.contracts.members import ENGINE_PID_LABEL
from robustrl.core.aio import cancel_and_wait
from robustrl.core.coordinator_client import NO_LEADER_ANSWER, CoordinatorClient
from robustrl.core.etcd_client import etcd_unavailable, until_etcd_answers
from robustrl.core.interceptors import REPEAT_WINDOW_S, Repeats
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime, long_lived_objects
from robustrl.generation.engine import (
    ContextExceeded,
    Engine,
    SamplingParams,
    SourceGone,
    WeightsRefused,
)
from robustrl.generation.prompts import NoChatTemplate, prompt_text, render
from robustrl.generation.rewards import RewardError, RewardFn, load_reward, score
from robustrl.v1 import coordinator_pb2, trainer_pb2
from robustrl.weights import (
    WeightIntegrityError,
    WeightTransport,
    latest_announcement,
    make_transport,
)
from services.rollout.config import RolloutSettings
from services.rollout.engines import build_engine, engine_context
from services.rollout.gauges import GenerationMeter, keep_gauges_fresh
from services.rollout.stream import TrajectoryStream

log = get_logger(__name__)

RPC_DEADLINE = 10.0

WARM_POLL_S = 0.25
"""How often a standby rollout prepared for a job looks for a new weight version."""

ENGINE_WATCH_S = 0.5
"""How often a rollout checks that its engine's own process (vLLM's engine core) still lives."""

RETRIED_CODES = NO_LEADER_ANSWER | {grpc.StatusCode.ABORTED}
"""Coordinator answers a completion is sent again after: no leader, none in time, or the job
changed under it (it says to retry)."""


class JobError(Exception):
    """This rollout cannot do the job's work; the coordinator fails the job with the message."""


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
        self.engine: Engine | None = None
        self.reward: RewardFn | None = None
        self.transport: WeightTransport | None = None
        self.stream = TrajectoryStream(runtime, job_id)
        self.meter = GenerationMeter(runtime.progress.counters)
        self.loaded_epoch = 0  # trainer epoch of the weights in the engine (0: from disk)
        self._tasks: list[asyncio.Task[None]] = []
        self._warm: asyncio.Task[None] | None = None
        self._warm_ends = asyncio.Event()
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
        # The lengths are checked against the model's context before an engine starts: a
        # vLLM engine takes seconds to start and would only be stopped again.
        try:
            context = engine_context(self.spec, self.settings, path)
        except ValueError as exc:
            raise InvalidArgument(f"model.path: {exc}") from exc
        rollout = self.spec.rollout
        if rollout.max_new_tokens >= context:
            raise InvalidArgument(
                f"rollout.max_new_tokens: {rollout.max_new_tokens} tokens leave no room for a "
                f"prompt in the {context} positions of context the engine serves"
            )
        longest = rollout.max_new_tokens * rollout.long_tail_factor
        if rollout.long_tail_every and longest >= context:
            raise InvalidArgument(
                f"rollout.long_tail_factor: a long-tail group generates max_new_tokens * "
                f"long_tail_factor = {longest} tokens, more than the {context} positions of "
                "context the engine serves leave room for after a prompt"
            )
        try:
            with long_lived_objects():
                self.engine = build_engine(self.spec, self.settings)
        except Exception as exc:  # the model, or an engine that cannot start here
            raise InvalidArgument(
                f"rollout.engine: {self.spec.rollout.engine} cannot run model.path {path}: {exc}"
            ) from exc
        log.info(
            "rollout.engine_ready",
            job=self.job_id,
            engine=rollout.engine,
            context=self.engine.max_positions,
        )

    def keep_warm(self) -> None:
        """Prepared as a standby for the job: pull each weight version as it is announced (and
        serve it to peers, as any rollout's transport does), so that once bound this rollout
        generates with the current weights at once. Ends when the worker starts or stops."""
        self._warm = asyncio.create_task(self._follow_weights(), name=f"warm-{self.job_id}")
        self._warm.add_done_callback(self._ended)

    async def _follow_weights(self) -> None:
        await self._open_transport()
        while not self._warm_ends.is_set():
            try:
                await self._ensure_weights(0, report=False)
            except JobError as exc:  # once bound, the worker meets it again and reports it
                log.warning("rollout.warm_weights_refused", job=self.job_id, error=str(exc))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._warm_ends.wait(), WARM_POLL_S)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._generate_loop(), name=f"generate-{self.job_id}"),
            asyncio.create_task(self.stream.run(), name=f"stream-{self.job_id}"),
            asyncio.create_task(
                keep_gauges_fresh(self.meter, self.runtime.progress, lambda: self.transport),
                name=f"gauges-{self.job_id}",
            ),
            asyncio.create_task(self._watch_engine(), name=f"engine-{self.job_id}"),
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

    async def _watch_engine(self) -> None:
        """Name the engine's own process in this member's record, then watch it: an engine
        process that dies ends this rollout as a crash at once, idle or not, rather than leave
        it beating with nothing behind it."""
        assert self.engine is not None
        pids = self.engine.engine_pids()
        if not pids:
            return  # the engine runs in this process: it dies with it
        try:
            await self.runtime.update_member(labels={ENGINE_PID_LABEL: str(pids[0])})
        except Exception as exc:  # etcd away: the label is for tools, the watch goes on
            log.info("rollout.engine_label_failed", error=repr(exc))
        while True:
            failure = self.engine.failure()
            if failure is not None:
                break
            await asyncio.sleep(ENGINE_WATCH_S)
        log.error("rollout.engine_failed", job=self.job_id, error=failure)
        self.runtime.crash(failure)

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, self._warm)
        if self.transport is not None:
            await self.transport.close()
        await self.coordinator.close_channels()
        if self.engine is not None:
            if self.engine.engine_pids() and self.runtime.member is not None:
                with contextlib.suppress(Exception):  # the label only names what was running
                    await asyncio.wait_for(
                        self.runtime.update_member(labels={ENGINE_PID_LABEL: None}), RPC_DEADLINE
                    )
            await asyncio.to_thread(self.engine.close)

    # ------------------------------------------------------------------ generation

    async def _open_transport(self) -> None:
        # Pulled versions are kept and served to peers (relay), so a new or recovered rollout
        # does not have to go to the trainer for them.
        if self.transport is not None:
            return
        assert self.runtime.client is not None
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

    async def _generate_loop(self) -> None:
        progress = self.runtime.progress
        if self._warm is not None:  # a standby's pull under way is finished, not cut off
            self._warm_ends.set()
            await self._warm
        await self._open_transport()
        lease_failures = Repeats(REPEAT_WINDOW_S)
        request_id = ""
        generated_any = False
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
                if not generated_any:  # when a replacement began to serve (benchmarks/ettr.py)
                    generated_any = True
                    assert self.engine is not None  # built by _ensure_weights
                    log.info(
                        "rollout.first_batch",
                        job=self.job_id,
                        version=self.engine.weight_version,
                        at=time.time(),
                    )
                progress.phase = "generating"
                generated_from = time.time()
                generated = await self._generate(list(reply.groups))
                generated_to = time.time()
            except JobError as exc:
                log.error("rollout.job_error", job=self.job_id, error=str(exc))
                await self._complete([], error=str(exc))
                return
            trajectories = generated.trajectories
            self.stream.send(trajectories)
            progress.phase = "delivering"
            await self.stream.wait_received([t.trajectory_id for t in trajectories])
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
            prompts = [render(self.engine.tokenizer, g.prompt, g.messages) for g in groups]
        except NoChatTemplate as exc:  # the job's input: the model cannot take it
            raise JobError(f"cannot render group {groups[0].group_id}: {exc}") from exc
        try:
            with self.meter.generating(len(groups)):
                outputs = await asyncio.to_thread(
                    self.engine.generate, prompts, params, self.meter.on_tokens
                )
        except ContextExceeded as exc:  # the job's input: name the row to fix
            group = groups[exc.index]
            raise JobError(
                f"cannot generate group {group.group_id} (dataset item {group.item_id!r}): {exc}"
            ) from exc
        except ValueError as exc:
            raise JobError(f"cannot generate: {exc}") from exc
        for group, completions in zip(groups, outputs, strict=True):
            asked = prompt_text(group.prompt, group.messages)
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
                    reward = score(self.reward, asked, completion.text, group.answer)
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

    async def _ensure_weights(self, min_version: int, *, report: bool = True) -> None:
        """Load the newest announced version; wait for one >= min_version if needed. A standby
        (`report` False) pulls without entering the pulling phase: it is not at work."""
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
                if report:
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
                # Swapped between generation batches: no batch ever mixes two versions. In a
                # thread: an engine in other processes copies the version from this process's
                # UCX holder, which the event loop serves meanwhile.
                started = time.perf_counter()
                try:
                    with self.meter.updating():
                        await asyncio.to_thread(
                            self.engine.load_weights,
                            tensors,
                            latest.version,
                            self.transport.local_source(latest.version),
                        )
                except SourceGone as exc:  # superseded while the engine copied it: the next
                    log.info("rollout.weights_superseded", version=latest.version, error=str(exc))
                    continue
                except WeightsRefused as exc:
                    # The version, not this host: a replacement on the same checkpoint would
                    # refuse it too. The job fails with what is wrong.
                    raise JobError(
                        f"weight version {latest.version} cannot be loaded into the "
                        f"{self.spec.rollout.engine} engine: {exc}"
                    ) from exc
                self.loaded_epoch = latest.trainer_epoch
                log.info(
                    "rollout.weights_loaded",
                    job=self.job_id,
                    version=latest.version,
                    load_s=round(time.perf_counter() - started, 4),
                )
            if self.engine.weight_version >= min_version:
                return
            if self.runtime.progress.phase != "waiting_weights":
                self.runtime.progress.enter("waiting_weights")
            await asyncio.sleep(0.1)

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
