"""Inference engines: the interface a rollout samples through, and the torch engine for CPU.

An engine samples ``n`` completions per prompt and reports, for each, the sampled token ids,
the log-probability of each sampled token under the sampling policy, and why it stopped.
Those logprobs are the "old" (behaviour) logprobs of the GRPO ratio, so they follow the
trainer's convention exactly: ``log_softmax(logits.float() / T)`` at temperature T > 0.
At T = 0 the engine decodes greedily and reports ``log_softmax(logits.float())`` (T = 1);
greedy samples are for evaluation, not training.

``min_new_tokens`` takes the end-of-sequence token out of the distribution a token is drawn
from until that many tokens are sampled (long-tail generations for tests). The reported
logprob stays that of the model's own distribution, which is what the trainer recomputes, so
the GRPO ratio is still 1 on policy.

Progress: ``generate`` calls ``on_tokens(k)`` as tokens are produced, ``k`` being how many
completions got a new token, so a caller can tell a long generation from a hung one. The torch
engine calls it after every decode step, from the thread that runs ``generate``.

A row whose distribution is not a distribution (NaN or Inf logits from broken weights or
hardware) does not crash the batch: it gets the end-of-sequence token, and its non-finite
logprob is reported as is, for the rollout to count and drop.

Weights are swapped whole and atomically between generation calls (``load_weights``); a
tensor with an unknown name, a missing name, or the wrong shape or dtype rejects the whole
update and leaves the model as it was.
"""

from __future__ import annotations

import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from robustrl.generation.serving import (
    TensorSpec,
    checkpoint_dtype,
    checkpoint_specs,
    distinct_tensors,
)
from robustrl.weights.transport import LocalSource

__all__ = ["TensorSpec"]  # re-exported: engines and their callers name it from here

FinishReason = Literal["stop", "length"]

TokenCallback = Callable[[int], None]
"""Called with how many completions got a new token (see the module docstring)."""


class ContextExceeded(ValueError):
    """A prompt leaves no room for max_new_tokens in the model's context: the job's input."""

    index: int = 0
    """Which prompt of the batch (`Engine.encode_all`)."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """0 decodes greedily."""
    max_new_tokens: int = 8
    min_new_tokens: int = 0
    """End-of-sequence cannot be sampled before this many tokens (0: any time); at most
    max_new_tokens. Equal to it: every completion is exactly max_new_tokens long."""
    seed: int = 0
    """Same seed, prompts, params and weights -> same completions."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    """Sampled tokens, including the end-of-sequence token when finish_reason is "stop"."""
    logprobs: list[float]
    """Behaviour logprob of each token in token_ids (see the module docstring)."""
    finish_reason: FinishReason
    text: str
    """Decoded completion without special tokens: what a reward function sees."""


class WeightsRefused(ValueError):
    """A weight update whose names, shapes or dtypes are not the model's: nothing changed. Any
    engine on the same checkpoint refuses it the same way."""


class SourceGone(RuntimeError):
    """The holder a version was to be copied from no longer holds it (a newer one superseded
    it): nothing was loaded, and the engine keeps the weights it had."""


class Engine(ABC):
    """What a rollout needs from an inference engine."""

    weight_version: int
    """Version of the weights in use: set by load_weights, 0 for the weights loaded at start."""
    tokenizer: PreTrainedTokenizerBase
    max_positions: int
    _specs: dict[str, TensorSpec]

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order. ``on_tokens`` hears of
        new tokens as they come (per decode step, or coarser where the engine cannot say)."""

    @abstractmethod
    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        source: LocalSource | None = None,
    ) -> None:
        """Replace every weight at once. Raises ValueError, changing nothing, when the set of
        names, a shape or a dtype does not match the model. ``version`` becomes
        ``weight_version`` (default: the current one plus one). ``source``, where this host's
        weight transport holds the same version, lets an engine whose model lives in another
        process copy it from there instead of being handed the tensors."""

    def close(self) -> None:  # noqa: B027 - an in-process engine has nothing to stop
        """Stop what the engine started (processes, threads). Idempotent."""

    def failure(self) -> str | None:
        """Why the engine can no longer serve (a process of its own died); None while it can.
        An in-process engine fails with its process."""
        return None

    def engine_pids(self) -> list[int]:
        """Processes the engine runs in besides the caller's, its main one first (none for an
        in-process engine)."""
        return []

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Name -> shape and dtype of every weight load_weights expects."""
        return dict(self._specs)

    def encode_all(self, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
        """`encode` of each prompt; a ContextExceeded says which prompt in its `index`."""
        encoded = []
        for index, prompt in enumerate(prompts):
            try:
                encoded.append(self.encode(prompt, max_new_tokens))
            except ContextExceeded as exc:
                exc.index = index
                raise
        return encoded

    def encode(self, prompt: str, max_new_tokens: int) -> list[int]:
        """Token ids of ``prompt`` (with bos); ContextExceeded if it leaves no room to
        generate."""
        ids = list(self.tokenizer(prompt)["input_ids"])
        limit = self.max_positions - max_new_tokens
        if len(ids) > limit:
            raise ContextExceeded(
                f"prompt of {len(ids)} tokens exceeds the context: {self.max_positions} positions "
                f"- max_new_tokens {max_new_tokens} = {limit}"
            )
        return ids


def sampling_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities the engine samples from (and reports) at ``temperature``."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def validate_weights(
    expected: dict[str, TensorSpec], named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Check a full weight set against ``expected``; returns it by name or raises ValueError
    listing every problem."""
    incoming: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, tensor in named_tensors:
        if name in incoming:
            problems.append(f"{name}: given twice")
        incoming[name] = tensor
    missing = sorted(expected.keys() - incoming.keys())
    unknown = sorted(incoming.keys() - expected.keys())
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown names: {', '.join(unknown)}")
    for name, tensor in incoming.items():
        spec = expected.get(name)
        if spec is None:
            continue
        if tuple(tensor.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {spec.shape}")
        if tensor.dtype != spec.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {spec.dtype}")
    if problems:
        raise WeightsRefused("weight update rejected, model unchanged: " + "; ".join(problems))
    return incoming


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by, which is also the name of the
    output field that returns it: `cache` from transformers 5 (which deprecates
    `past_key_values`, to be removed in 5.40), `past_key_values` before. Read from the class,
    so a wrapped forward (tests pace or hold it) does not hide it."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TorchEngine(Engine):
    """Batched sampling with a Hugging Face causal LM and its KV cache (CPU or one GPU)."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model.eval()
        self._cache = cache_keyword(model)
        self.tokenizer = tokenizer
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        if not isinstance(eos, int) or not isinstance(pad, int):
            raise ValueError("tokenizer needs eos and pad tokens")
        self.eos_id: int = eos
        self.pad_id: int = pad
        self.max_positions = int(getattr(model.config, "max_position_embeddings"))  # noqa: B009
        self.weight_version = 0
        self.agree: Callable[[bool], bool] | None = None
        """Set where the model is sharded over ranks that generate together (each forward a
        collective): whether every row is done, as all of them agree, so that each rank runs
        the same number of forwards however its own bits came out."""
        # Held for a whole generate() and a whole load_weights(), so a weight swap lands
        # between generation calls, never inside one.
        self._lock = threading.Lock()
        # A tied matrix once, under the name its checkpoint keeps (serving.py).
        self._specs = {
            name: TensorSpec(tuple(t.shape), t.dtype)
            for name, t in distinct_tensors(model.state_dict().items())
        }

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> TorchEngine:
        """The model in `dtype`, by default its checkpoint's own (fp32 where it mixes)."""
        if dtype is None:
            dtype = checkpoint_dtype(checkpoint_specs(model_dir)) or torch.float32
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return cls(model.to(device), tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
    ) -> list[list[Completion]]:
        encoded = self.encode_all(prompts, params.max_new_tokens)
        if not encoded:
            return []
        rows = [ids for ids in encoded for _ in range(params.n)]
        with self._lock:
            tokens, logprobs, finished = self._sample(rows, params, on_tokens)
        completions = [
            Completion(
                prompt_ids=list(rows[r]),
                token_ids=tokens[r],
                logprobs=logprobs[r],
                finish_reason="stop" if finished[r] else "length",
                text=str(self.tokenizer.decode(tokens[r], skip_special_tokens=True)),
            )
            for r in range(len(rows))
        ]
        n = params.n
        return [completions[p * n : (p + 1) * n] for p in range(len(encoded))]

    def _pick(
        self,
        logp: torch.Tensor,
        params: SamplingParams,
        suppress_eos: bool,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """The next token of each row, drawn from ``logp`` (eos masked out if asked)."""
        if suppress_eos:
            logp = logp.index_fill(1, torch.tensor([self.eos_id], device=logp.device), -torch.inf)
        probs = logp.exp()
        total = probs.sum(-1)
        # NaN anywhere makes the sum NaN; all mass on a masked eos makes it 0.
        broken = ~(torch.isfinite(total) & (total > 0))
        if params.temperature > 0:
            # A broken row draws from a stand-in (uniform) and is given eos below.
            probs = torch.where(broken[:, None], 1.0, probs)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = logp.argmax(-1)
        return torch.where(broken, torch.full_like(token, self.eos_id), token)

    @torch.no_grad()
    def _sample(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        device = self.device
        batch, width = len(rows), max(len(r) for r in rows)
        # Left padding puts every row's last prompt token in the last column, so one decode
        # step serves the whole batch; position ids skip the padding.
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long, device=device)
        attention = torch.zeros((batch, width), dtype=torch.long, device=device)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids) :] = torch.tensor(ids, device=device)
            attention[i, width - len(ids) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        generator = torch.Generator(device=device).manual_seed(params.seed)

        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self._cache)
        logits = out.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        sampled: list[torch.Tensor] = []
        sampled_lp: list[torch.Tensor] = []
        alive: list[torch.Tensor] = []
        for t in range(params.max_new_tokens):
            logp = sampling_logprobs(logits, params.temperature)
            token = self._pick(logp, params, t < params.min_new_tokens, generator)
            alive.append(~done)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            sampled.append(token)
            sampled_lp.append(logp.gather(1, token[:, None]).squeeze(1))
            if on_tokens is not None:
                on_tokens(int(alive[-1].sum()))
            done = done | (token == self.eos_id)
            finished = bool(done.all())
            if self.agree is not None:
                finished = self.agree(finished)
            if finished or t == params.max_new_tokens - 1:
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache: cache},
            )
            cache = getattr(out, self._cache)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        tokens_t = torch.stack(sampled, dim=1).cpu()
        lp_t = torch.stack(sampled_lp, dim=1).cpu()
        alive_t = torch.stack(alive, dim=1).cpu()
        lengths = alive_t.sum(dim=1).tolist()
        tokens = [tokens_t[i, : lengths[i]].tolist() for i in range(batch)]
        logprobs = [lp_t[i, : lengths[i]].tolist() for i in range(batch)]
        return tokens, logprobs, done.cpu().tolist()

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        source: LocalSource | None = None,
    ) -> None:
        incoming = validate_weights(self._specs, named_tensors)
        with self._lock, torch.no_grad():
            # Validation above guarantees every copy_ below succeeds, so the swap is all or none.
            # A tied alias shares its storage with a name copied here.
            for name, target in distinct_tensors(self.model.state_dict().items()):
                target.copy_(incoming[name])
            self.weight_version = self.weight_version + 1 if version is None else version
