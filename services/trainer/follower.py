"""`python -m services.trainer.follower`: trainer rank r > 0 of a data-parallel job.

Rank 0, the bound trainer, starts it (`spawn_followers`, services/trainer/ranks/followers.py)
with the job id, its rank, the world size, the rendezvous address and the JobSpec as a JSON
file.
etcd and service settings come as ROBUSTRL_* env. The follower registers as a trainer
member labelled `follower=true` and bound to the job, so the coordinator never binds it to
another job. It serves only gRPC health and streams heartbeats like every member.

Then it does what rank 0 says. It loads the model from `model.path` and takes rank 0's
parameters and optimizer state. For every batch rank 0 broadcasts, it trains its shard and
joins the gradient sum, in the same phases as rank 0 and with rank 0's `step` counter. A
`None` batch ends the job: it says goodbye, deregisters and exits 0. If rank 0 goes away
(a gloo or store error, or it is no longer our parent) it logs `trainer.follower_failed`
and exits 1. SIGTERM exits 143 after the same goodbye.

Settings are parsed before torch is imported, so a bad one fails fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from robustrl.contracts.jobspec import JobSpec
from robustrl.core.aio import run_process
from robustrl.core.config import EtcdSettings
from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime, long_lived_objects
from services.trainer.config import TrainerSettings

if TYPE_CHECKING:
    import torch

    from services.trainer.grpo import GRPOTrainer, Sample

log = get_logger(__name__)

EXIT_FAILED = 1
EXIT_TERMINATED = 128 + signal.SIGTERM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.trainer.follower")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True, help="rank 0's rendezvous host:port")
    parser.add_argument("--spec", type=Path, required=True, help="the JobSpec as JSON")
    parser.add_argument("--timeout", type=float, default=300.0, help="gloo timeout, seconds")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when it is gone")
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=0,
        help="failure injection: SIGSTOP this process in step N's forward_backward (1-based)",
    )
    parser.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="failure injection: raise in step N's forward_backward (1-based), as a device "
        "error would",
    )
    args = parser.parse_args(argv)
    if not 0 < args.rank < args.world_size:
        parser.error(f"--rank must be in 1..{args.world_size - 1}")
    return args


def load_model(spec: JobSpec, rank: int) -> tuple[torch.nn.Module, int]:
    """The policy from `model.path` on this rank's device, loaded as rank 0 loads it, and the
    tokenizer's pad id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.devices import compute_for

    compute = compute_for(spec.trainer, rank)
    path = Path(spec.model.path)
    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(compute.device)
    return model, int(tokenizer.pad_token_id)


def make_trainer(spec: JobSpec, rank: int, model: torch.nn.Module, pad_id: int) -> GRPOTrainer:
    """The GRPO trainer of `model`; an fsdp job's shards it first (the group must be up)."""
    from services.trainer.devices import compute_for
    from services.trainer.grpo import GRPOTrainer, grpo_config
    from services.trainer.ranks.sharding import shard_model

    if spec.trainer.strategy == "fsdp":
        model = shard_model(model)
    autocast = compute_for(spec.trainer, rank).autocast
    return GRPOTrainer(model, grpo_config(spec), pad_id=pad_id, autocast=autocast)


def _nan_injector(
    spec: JobSpec, rank: int, step: int
) -> Callable[[list[Sample]], list[Sample]] | None:
    """spec.faults on this rank: this step's first sample gets a NaN advantage."""
    faults = getattr(spec, "faults", None)
    if faults is None or faults.nan_rank != rank or step + 1 not in faults.nan_loss_steps:
        return None

    def poison(samples: list[Sample]) -> list[Sample]:
        if not samples:
            return samples
        log.warning("trainer.fault_injected", step=step + 1, rank=rank, fault="nan")
        return [dataclasses.replace(samples[0], advantage=float("nan")), *samples[1:]]

    return poison


def _count_nonfinite(progress: Progress, where: str, step: int) -> None:
    name = f"nonfinite_{where}"
    progress.set_counter(name, progress.counters.get(name, 0.0) + 1)
    progress.set_counter("step", float(step))
    log.error("trainer.nonfinite", step=step, rank=progress.rank, where=where)
    progress.urge()


def run_rank(args: argparse.Namespace, spec: JobSpec, progress: Progress, threads: int) -> int:
    """The follower's work, on a thread of its own; returns the exit code."""
    progress.enter("loading")
    sharded = spec.trainer.strategy == "fsdp"
    with long_lived_objects(start=True):
        import torch

        from services.trainer import ranks
        from services.trainer.devices import compute_for

        torch.set_num_threads(threads)
        compute = compute_for(spec.trainer, args.rank)
        if compute.device.type == "cuda":
            torch.cuda.set_device(compute.device)
        # Loaded before the group forms: rank 0 waits in the first collective meanwhile.
        model, pad_id = load_model(spec, args.rank)
    group = ranks.RankGroup(
        args.rank,
        args.world_size,
        args.master,
        progress,
        args.timeout,
        backend=compute.backend,
        sharded=sharded,
    )
    written = None
    try:
        progress.enter("starting_ranks")
        group.init()
        with long_lived_objects(start=True):
            trainer = make_trainer(spec, args.rank, model, pad_id)
        if sharded:
            ranks.start_sharded(group, trainer, "", {})
        else:
            group.broadcast_state(trainer.model, trainer.optimizer)
        while True:
            progress.enter("waiting_data")
            order = group.broadcast_batch(None)
            if order is None:
                if written is not None:
                    written.result()  # this rank's part of the last checkpoint is on disk
                log.info("trainer.follower_done", job=args.job, rank=args.rank)
                return 0
            if isinstance(order, ranks.SaveOrder):
                progress.enter("checkpoint")
                written = ranks.save_rank(group, trainer, order, written)
                continue
            if order.step + 1 == args.stop_at_step:
                progress.enter("forward_backward")
                log.warning("trainer.fault_injected", step=order.step + 1, fault="sigstop")
                os.kill(os.getpid(), signal.SIGSTOP)
            if order.step + 1 == args.fail_at_step:
                progress.enter("forward_backward")
                log.warning("trainer.fault_injected", step=order.step + 1, fault="error")
                raise RuntimeError(
                    f"failure injection: rank {args.rank} fails in step {order.step + 1}"
                )
            outcome = ranks.run_step(
                group, trainer, order, inject=_nan_injector(spec, args.rank, order.step)
            )
            if sharded:
                group.gather_weights(trainer.model)  # rank 0 keeps the whole weights
            if outcome.metrics.nonfinite_where:
                _count_nonfinite(progress, outcome.metrics.nonfinite_where, order.step + 1)
            progress.set_counter("step", float(order.step + 1))
    except Exception as exc:  # rank 0 is gone or the group broke: nothing to do but leave
        log.error("trainer.follower_failed", job=args.job, rank=args.rank, error=repr(exc))
        return EXIT_FAILED
    finally:
        group.close()


async def serve(args: argparse.Namespace, settings: TrainerSettings, etcd: EtcdSettings) -> int:
    spec = JobSpec.model_validate_json(args.spec.read_text())
    runtime = ServiceRuntime(
        "trainer",
        settings,
        etcd,
        service_names=[],
        heartbeats=True,
        labels={"rank": str(args.rank), "follower": "true"},
    )
    progress = runtime.progress
    progress.job_id, progress.rank = args.job, args.rank
    progress.counters = {"step": 0.0, "collective_seq": 0.0}
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def finish(code: int) -> None:
        if not done.done():
            done.set_result(code)

    await runtime.start(on_fenced=lambda: finish(EXIT_FAILED))
    await runtime.update_member(job_id=args.job)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, finish, EXIT_TERMINATED)

    def work() -> None:
        code = EXIT_FAILED
        try:
            code = run_rank(args, spec, progress, settings.torch_threads)
        except BaseException as exc:
            log.error("trainer.follower_failed", job=args.job, rank=args.rank, error=repr(exc))
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is already gone
                loop.call_soon_threadsafe(finish, code)

    # A daemon thread: when rank 0 is gone the thread may sit in gloo until its timeout,
    # and nothing should wait for it on the way out. It logs with this service's context.
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(work,), name="rank", daemon=True).start()
    orphan_watch = asyncio.create_task(_watch_parent(args.parent_pid, finish))
    code = await done
    orphan_watch.cancel()
    await runtime.shutdown()
    return code


async def _watch_parent(parent_pid: int, finish: Callable[[int], None]) -> None:
    while parent_pid:
        if os.getppid() != parent_pid:
            log.error("trainer.follower_failed", error=f"rank 0 (pid {parent_pid}) is gone")
            finish(EXIT_FAILED)
            return
        await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings, etcd = TrainerSettings(), EtcdSettings()
    return run_process(serve(args, settings, etcd))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the rank thread may still be inside gloo, and interpreter teardown
    # around a live collective can hang.
    os._exit(code)
