"""Data-parallel trainer ranks on gloo, and the watchdog around their collectives.

Rank 0 is the bound trainer. It starts ranks 1..N-1 as follower processes on its own host
(`python -m services.trainer.follower`), and every rank registers and streams its own
heartbeat. Each step, rank 0 broadcasts the whole batch, and each rank trains on its
`shard`. The loss is divided by the *batch's* token count, so the shards' gradients sum to
the single-rank gradient. One flattened all-reduce sums them (with a non-finite flag), so
every rank applies the same update to the same parameters. Per step, on every rank:

    broadcast_batch -> forward_backward (own shard) -> sync_gradients -> optimizer
    -> gather_step (metrics and a parameter fingerprint, to catch diverged ranks)

The watchdog: every collective goes through `RankGroup.collective`. It numbers the
collective (counter `collective_seq`; every rank runs the same collectives in the same
order, so the numbers line up across ranks) and reports phase `collective`, with its
start time, while inside. The monitor's `collective_hangs` (services/monitor/
progress_detectors.py) then names the rank whose `collective_seq` is below the number the
other ranks have waited in past the budget. A thread on each rank also logs
`trainer.collective_waiting`, naming the collective, once a wait passes `warn_after`.

A follower waiting for rank 0's next batch is idle, not hung: rank 0 may be evaluating,
checkpointing or waiting for data for minutes. So it waits outside gloo, on a key in the
rendezvous store that rank 0 sets just before it broadcasts, in phase `waiting_data` with
no timeout. The broadcast itself is then an ordinary collective on every rank. A follower
stopped while it waits has not entered the broadcast rank 0 is waiting in, so it is named
too.

Rank 0 (the trainer worker) runs all of this from a thread, because every call blocks:

    ranks = LeaderRanks(runtime.progress, timeout_s=300)
    spec_path.write_text(spec.model_dump_json())
    ranks.start(trainer, spec_path=spec_path, job_id=job_id, world_size=W,
                etcd=runtime.etcd_settings, instance_id=runtime.instance_id,
                settings=runtime.settings, torch_threads=settings.torch_threads)
    metrics = ranks.step(trainer, samples, step=s)  # instead of trainer.step(samples)
    ranks.close()  # followers exit 0; those that do not are stopped by pid

`start` goes after any checkpoint restore: it broadcasts rank 0's parameters and optimizer
state, so every rank starts identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from robustrl.core.config import EtcdSettings, ServiceSettings
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from services.trainer.grpo import GRPOTrainer, Sample, StepMetrics

log = get_logger(__name__)

T = TypeVar("T")

IDLE_WAIT = timedelta(days=365)
"""How long a follower waits for rank 0's next batch: as long as it takes. Rank 0 going away
ends the wait at once (the store's connection drops, or the follower is orphaned)."""

RANK_EXIT_GRACE = 2.0
"""How long rank 0, its collective broken, waits for a follower to exit to name it as the
cause (a follower that failed closes its connections, then exits)."""

_JOINED = "robustrl/joined/{rank}"
_GO = "robustrl/go/{n}"


def shard(samples: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Rank `rank`'s part of one step's samples: every `world_size`-th from index `rank`.

    Strided rather than contiguous, so each rank gets a similar mix of groups and lengths.
    A rank may get none (fewer samples than ranks); it still joins the gradient sum.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return list(samples[rank::world_size])


class RankExited(RuntimeError):
    """A follower rank ended while rank 0 worked with it: the step (or start) cannot finish."""


class RanksDiverged(RuntimeError):
    """The ranks' parameters differ after a step: the data-parallel update is broken."""


@dataclass(frozen=True)
class StepOrder:
    """What rank 0 broadcasts each step: the step number and the whole batch."""

    step: int
    samples: list[Sample]


@dataclass(frozen=True)
class StepOutcome:
    metrics: StepMetrics
    """The batch's metrics (summed over ranks), except `nonfinite_where`: this rank's."""
    fingerprints: list[tuple[float, float]]
    """Per rank, after the step: (sum, sum of squares) of its parameters, in float64."""


class RankGroup:
    """One rank's membership of the gloo group, with every collective it runs watched."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master: str,
        progress: Progress,
        timeout_s: float,
        *,
        warn_after: float | None = None,
    ) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master {master!r} is not host:port")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = int(port)
        self.progress = progress
        self.timeout = timedelta(seconds=timeout_s)
        self.warn_after = warn_after if warn_after is not None else min(30.0, timeout_s / 2)
        self.seq = 0
        self.broken = False
        """A collective failed: the group cannot be used again (close it)."""
        self._store: dist.TCPStore | None = None
        self._signals: dist.TCPStore | None = None
        self._broadcasts = 0
        self._initialised = False
        self._current: tuple[str, int, float] | None = None
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        progress.rank = rank
        progress.set_counter("collective_seq", 0.0)

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ set-up

    def listen(self) -> str:
        """Rank 0: open the rendezvous store (port 0 picks a free one); returns host:port."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 hosts the rendezvous store")
        if self._store is None:
            self._store = dist.TCPStore(
                self.host,
                self.port,
                self.world_size,
                is_master=True,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            self.port = int(self._store.port)
        return self.master

    def init(self, check: Callable[[], None] | None = None) -> None:
        """Join the group; blocks until every rank has (at most the timeout).

        Rank 0 waits for each follower to announce itself before the gloo rendezvous, and
        calls `check` while it waits, so a follower that dies on the way fails this at once
        rather than at the timeout.
        """
        if self.rank == 0:
            self.listen()
            assert self._store is not None
            store = self._store
            waiting = [_JOINED.format(rank=r) for r in range(1, self.world_size)]
            deadline = time.monotonic() + self.timeout.total_seconds()
            while waiting and not store.check(waiting):
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"trainer ranks did not join within {self.timeout.total_seconds():.0f}s"
                    )
                time.sleep(0.05)
        else:
            store = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=False, timeout=self.timeout
            )
            # A second connection for the idle wait between steps, which has no timeout.
            self._signals = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=False, timeout=IDLE_WAIT
            )
            store.set(_JOINED.format(rank=self.rank), "1")
            self._store = store
        dist.init_process_group(
            "gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=self.timeout
        )
        self._initialised = True
        self._watchdog = threading.Thread(target=self._watch, name="collective-watchdog")
        self._watchdog.daemon = True
        self._watchdog.start()
        log.info("trainer.rank_joined", rank=self.rank, world_size=self.world_size)

    def close(self) -> None:
        """Leave the group (idempotent). Drops `collective_seq` from the beats."""
        self._closed.set()
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(Exception):  # after a peer died; nothing left to do
                dist.destroy_process_group()
        self._store = self._signals = None
        counters = {k: v for k, v in self.progress.counters.items() if k != "collective_seq"}
        self.progress.counters = counters

    # ------------------------------------------------------------------ the watchdog

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[int]:
        """Number the collective run inside, and report phase `collective` while in it.

        The phase the rank was in comes back afterwards with a fresh start time: the wait
        was covered by the collective budget, and counting it again against that phase's
        own budget would call a slow peer a hang of this rank.
        """
        self.seq += 1
        seq, before, since = self.seq, self.progress.phase, time.monotonic()
        self.progress.set_counter("collective_seq", float(seq))
        self.progress.enter("collective")
        self._current = (name, seq, since)
        log.debug("trainer.collective", name=name, seq=seq, rank=self.rank)
        try:
            yield seq
        except Exception as exc:
            self.broken = True
            log.error(
                "trainer.collective_failed",
                name=name,
                seq=seq,
                rank=self.rank,
                waited=round(time.monotonic() - since, 1),
                error=str(exc).splitlines()[0] if str(exc) else repr(exc),
            )
            raise
        finally:
            self._current = None
            self.progress.enter(before)

    def _watch(self) -> None:
        warned = 0
        while not self._closed.wait(1.0):
            current = self._current
            if current is None:
                continue
            name, seq, since = current
            waited = time.monotonic() - since
            if seq != warned and waited >= self.warn_after:
                warned = seq
                log.warning(
                    "trainer.collective_waiting",
                    name=name,
                    seq=seq,
                    rank=self.rank,
                    waited=round(waited, 1),
                )

    # ------------------------------------------------------------------ collectives

    def broadcast_batch(
        self, order: StepOrder | None, *, timeout_s: float | None = None
    ) -> StepOrder | None:
        """Rank 0 sends `order` (None: stop) to every rank; every rank returns it.

        Followers pass None and first wait, idle and without a timeout, until rank 0 is
        about to send.
        """
        self._broadcasts += 1
        go = _GO.format(n=self._broadcasts)
        if self.rank == 0:
            assert self._store is not None
            self._store.set(go, "1")
        else:
            assert self._signals is not None
            self._signals.wait([go])
        with self.collective("broadcast_batch"):
            received = self._broadcast_object(order, timeout_s)
        if self.rank == 0:
            assert self._store is not None
            # Every rank waited for this key before it could join the broadcast just done.
            self._store.delete_key(go)
        return received if isinstance(received, StepOrder) else None

    def broadcast_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes rank 0's parameters, buffers and optimizer state."""
        with self.collective("broadcast_state"):
            tensors = list(model.state_dict().values())
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                if self.rank == 0:
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                else:
                    flat = torch.empty(sum(t.numel() for t in same), dtype=dtype)
                dist.broadcast(flat, src=0)
                if self.rank != 0:
                    offset = 0
                    with torch.no_grad():
                        for t in same:
                            t.copy_(flat[offset : offset + t.numel()].view_as(t))
                            offset += t.numel()
            state = self._broadcast_object(optimizer.state_dict() if self.rank == 0 else None)
            if self.rank != 0:
                assert isinstance(state, dict)
                optimizer.load_state_dict(state)

    def sync_gradients(self, model: torch.nn.Module, *, nonfinite: bool = False) -> bool:
        """Sum every parameter's gradient over the ranks, in one flattened all-reduce.

        A sum, not a mean: each rank's loss is already divided by the whole batch's token
        count, so the sum is the batch's gradient. A parameter no rank has a gradient for
        keeps none, as in a single-rank step. `nonfinite` (this rank saw a NaN/Inf) rides in
        the same all-reduce; returns whether any rank did.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        parts = [
            p.grad.detach().reshape(-1).float()
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=torch.float32)
            for p in params
        ]
        has_grad = [1.0 if p.grad is not None else 0.0 for p in params]
        flat = torch.cat([*parts, torch.tensor([*has_grad, 1.0 if nonfinite else 0.0])])
        with self.collective("sync_gradients"):
            dist.all_reduce(flat)
        offset = 0
        flags = flat[-len(params) - 1 :]
        for i, p in enumerate(params):
            summed = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if flags[i] == 0:
                p.grad = None
            elif p.grad is not None:
                p.grad.copy_(summed)
            else:
                p.grad = summed.to(p.dtype).clone()
        return bool(flags[-1] > 0)

    def gather_step(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's `values` (same length everywhere), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.collective("gather_step"):
            dist.all_gather(rows, mine)
        return [row.tolist() for row in rows]

    def _broadcast_object(self, obj: object, timeout_s: float | None = None) -> object:
        """Rank 0's `obj` on every rank (pickled: ranks of one job trust each other)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.broadcast(size, src=0, async_op=True), timeout_s)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.broadcast(data, src=0, async_op=True), timeout_s)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    @staticmethod
    def _wait(work: dist.Work | None, timeout_s: float | None) -> None:
        assert work is not None
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))


def fingerprint(model: torch.nn.Module) -> tuple[float, float]:
    """(sum, sum of squares) of every parameter in float64: equal on ranks that agree."""
    total, squares = 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().double()
            total += float(flat.sum())
            squares += float((flat * flat).sum())
    return total, squares


def run_step(
    group: RankGroup,
    trainer: GRPOTrainer,
    order: StepOrder,
    *,
    inject: Callable[[list[Sample]], list[Sample]] | None = None,
) -> StepOutcome:
    """This rank's part of one data-parallel step; every rank calls it with the same order.

    `inject` may change this rank's shard before it trains (deterministic failure
    injection, e.g. a NaN sample).
    """
    progress = group.progress
    mine = shard(order.samples, group.rank, group.world_size)
    if inject is not None:
        mine = inject(mine)
    tokens = sum(len(s.completion_ids) for s in order.samples)

    def before_optimizer(nonfinite: bool) -> bool:
        anywhere = group.sync_gradients(trainer.model, nonfinite=nonfinite)
        progress.enter("optimizer")
        return anywhere

    progress.enter("forward_backward")
    local = trainer.step(mine, token_normaliser=tokens, before_optimizer=before_optimizer)
    rows = group.gather_step(
        [
            local.loss,
            local.ratio_mean,
            local.clip_frac,
            local.kl,
            float(local.num_tokens),
            float(local.num_samples),
            *fingerprint(trainer.model),
        ]
    )
    summed = [math.fsum(column) for column in zip(*(row[:6] for row in rows), strict=True)]
    metrics = dataclasses.replace(
        local,
        loss=summed[0],
        ratio_mean=summed[1],
        clip_frac=summed[2],
        kl=summed[3],
        num_tokens=int(summed[4]),
        num_samples=int(summed[5]),
    )
    return StepOutcome(metrics, [(row[6], row[7]) for row in rows])


# ---------------------------------------------------------------------- follower processes


def follower_instance_id(leader_instance_id: str, rank: int) -> str:
    return f"{leader_instance_id}-rank{rank}"


def spawn_followers(
    *,
    job_id: str,
    world_size: int,
    master: str,
    spec_path: Path,
    etcd: EtcdSettings,
    instance_id: str,
    settings: ServiceSettings | None = None,
    torch_threads: int = 1,
    timeout_s: float = 300.0,
    extra_args: Mapping[int, Sequence[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..world_size-1 as `python -m services.trainer.follower` processes.

    Each gets etcd's settings and this trainer's service settings (heartbeat interval, log
    format, hosts) as ROBUSTRL_* env, the instance id `<instance_id>-rank<r>`, a port of its
    own choosing, and this process's pid, so it exits if rank 0 goes away.
    `extra_args[r]` is appended to rank r's command line (failure injection in tests).
    """
    env = dict(os.environ)
    env.update(
        {
            "ROBUSTRL_ETCD_ENDPOINTS": etcd.endpoints,
            "ROBUSTRL_ETCD_PREFIX": etcd.prefix,
            "ROBUSTRL_ETCD_SESSION_TTL": str(etcd.session_ttl),
            "ROBUSTRL_ETCD_TIMEOUT": str(etcd.timeout),
            "ROBUSTRL_TRAINER_PORT": "0",
            "ROBUSTRL_TRAINER_TORCH_THREADS": str(torch_threads),
        }
    )
    if settings is not None:
        for name in (
            "bind_host",
            "advertise_host",
            "epoch",
            "heartbeat_interval",
            "shutdown_grace",
            "log_format",
            "log_level",
        ):
            env[f"ROBUSTRL_TRAINER_{name.upper()}"] = str(getattr(settings, name))
    procs = []
    for rank in range(1, world_size):
        env["ROBUSTRL_TRAINER_INSTANCE_ID"] = follower_instance_id(instance_id, rank)
        command = [
            sys.executable,
            "-m",
            "services.trainer.follower",
            f"--job={job_id}",
            f"--rank={rank}",
            f"--world-size={world_size}",
            f"--master={master}",
            f"--spec={spec_path}",
            f"--timeout={timeout_s}",
            f"--parent-pid={os.getpid()}",
            *(extra_args or {}).get(rank, ()),
        ]
        procs.append(subprocess.Popen(command, env=dict(env)))
        log.info("trainer.follower_started", job=job_id, rank=rank, pid=procs[-1].pid)
    return procs


def stop_followers(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for the followers to exit, then stop the rest by pid.

    Only these processes are signalled. A stopped (SIGSTOP) one is continued so that it
    sees the SIGTERM; one that ignores that is killed. Returns their exit codes.
    """
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            log.warning("trainer.follower_stopped", pid=proc.pid)
            proc.terminate()
            proc.send_signal(signal.SIGCONT)
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [int(proc.returncode) for proc in procs]


# ---------------------------------------------------------------------- rank 0


class LeaderRanks:
    """Rank 0's side: start the followers, run each step on every rank, stop them."""

    def __init__(
        self,
        progress: Progress,
        *,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        warn_after: float | None = None,
    ) -> None:
        self.progress = progress
        self.timeout_s = timeout_s
        self.host = host
        self.warn_after = warn_after
        self.group: RankGroup | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.fingerprints: list[tuple[float, float]] = []
        """Each rank's parameter fingerprint after the last step."""

    def start(
        self,
        trainer: GRPOTrainer,
        *,
        spec_path: Path,
        job_id: str,
        world_size: int,
        etcd: EtcdSettings,
        instance_id: str,
        settings: ServiceSettings | None = None,
        torch_threads: int = 1,
        follower_args: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """Spawn the followers, form the group, give every rank rank 0's state. Blocks.

        `spec_path` holds the JobSpec as JSON (the followers load the same model).
        """
        group = RankGroup(
            0,
            world_size,
            f"{self.host}:0",
            self.progress,
            self.timeout_s,
            warn_after=self.warn_after,
        )
        before = self.progress.phase
        self.progress.enter("starting_ranks")
        try:
            master = group.listen()
            self.procs = spawn_followers(
                job_id=job_id,
                world_size=world_size,
                master=master,
                spec_path=spec_path,
                etcd=etcd,
                instance_id=instance_id,
                settings=settings,
                torch_threads=torch_threads,
                timeout_s=self.timeout_s,
                extra_args=follower_args,
            )
            group.init(check=self._check_followers)
            group.broadcast_state(trainer.model, trainer.optimizer)
        except BaseException:
            stop_followers(self.procs, 0.0)
            self.procs = []
            group.close()
            raise
        finally:
            self.progress.enter(before)
        self.group = group

    def _check_followers(self) -> None:
        exited = self._exited()
        if exited:
            raise RankExited(f"{exited} before joining")

    def _exited(self, wait_s: float = 0.0) -> str:
        """Which followers have exited, and how ("trainer rank 1 exited with code 1"); empty if
        none has. Waits up to `wait_s` for one to: a rank that failed exits just after its
        connections close, and the other ranks learn of it from those."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = [(rank, proc.poll()) for rank, proc in enumerate(self.procs, start=1)]
            exited = [
                f"trainer rank {rank} exited with code {code}"
                for rank, code in codes
                if code is not None
            ]
            if exited or time.monotonic() >= deadline:
                return ", ".join(exited)
            time.sleep(0.05)

    def step(self, trainer: GRPOTrainer, samples: Sequence[Sample], *, step: int) -> StepMetrics:
        """`trainer.step(samples)` across every rank; the batch's metrics.

        `nonfinite_where` is rank 0's own: under data parallelism `nonfinite` may come from
        another rank, which reports its own counter. Raises `RanksDiverged` if the ranks'
        parameters differ afterwards.
        """
        if self.group is None:
            raise RuntimeError("LeaderRanks.start has not run")
        if not samples:
            raise ValueError("cannot train on an empty batch")
        order = StepOrder(step, list(samples))
        try:
            self.group.broadcast_batch(order)
            outcome = run_step(self.group, trainer, order)
        except Exception as exc:
            # gloo says only that a connection broke; name the rank that went away (its own
            # log, trainer.follower_failed, says why) so the recovery record does too.
            exited = self._exited(wait_s=RANK_EXIT_GRACE)
            if exited:
                first = str(exc).splitlines()[0] if str(exc) else repr(exc)
                raise RankExited(f"in step {step + 1}: {exited} ({first})") from exc
            raise
        self.fingerprints = outcome.fingerprints
        if any(fp != outcome.fingerprints[0] for fp in outcome.fingerprints):
            raise RanksDiverged(
                f"ranks' parameters differ after step {step}: {outcome.fingerprints}"
            )
        return outcome.metrics

    def close(self, timeout_s: float = 10.0) -> list[int]:
        """Tell the followers to exit, wait for them, stop those that do not; idempotent.

        Returns the followers' exit codes.
        """
        group, self.group = self.group, None
        if group is not None and not group.broken:
            try:
                group.broadcast_batch(None, timeout_s=timeout_s)
            except Exception as exc:  # a follower is gone or stopped: it is stopped below
                log.warning("trainer.ranks_stop_unheard", error=str(exc).splitlines()[0])
        codes = stop_followers(self.procs, timeout_s)
        if group is not None:
            group.close()
        if self.procs:
            log.info("trainer.ranks_closed", exit_codes=codes)
        self.procs = []
        return codes
