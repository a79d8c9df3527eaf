"""The vLLM engine for GPU hosts, behind the same ``Engine`` interface as the torch engine.

vLLM is an optional extra (``robustrl[gpu]``), so it is imported only when a VLLMEngine is
built; importing this module never needs it.

Logprobs: vLLM returns raw-logit logprobs unless asked otherwise. The engine is created
with ``logprobs_mode="processed_logprobs"`` so each reported logprob is taken after
temperature scaling, which is the distribution the token was sampled from and what the
trainer recomputes (``log_softmax(logits / T)``). At temperature 0 vLLM decodes greedily
and the logprobs are those of the unscaled logits, matching the torch engine's convention.
Prefix caching is off: a cache built under old weights must not serve new ones.
``min_new_tokens`` maps to vLLM's ``min_tokens`` (eos is not sampled before it).

Progress is coarse: ``LLM.generate`` reports nothing until the batch is done, so ``on_tokens``
hears of every token at once when it returns.

Weights: ``load_weights`` validates the whole update against the checkpoint's names,
shapes and dtypes first (nothing is sent to the workers on a mismatch), then hands it to
every worker through ``LLM.collective_rpc`` into the model's own ``load_weights``, which
understands Hugging Face names (fused qkv / gate_up projections included).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from robustrl.generation.engine import (
    Completion,
    Engine,
    SamplingParams,
    TensorSpec,
    TokenCallback,
    validate_weights,
)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); its methods run on every
    worker via ``collective_rpc``. ``self.model_runner`` is the worker's."""

    model_runner: Any

    def robustrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


def checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Name -> shape/dtype of every tensor in a Hugging Face safetensors checkpoint (header
    only; no tensor is read)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                dtype_name = sl.get_dtype()
                if dtype_name not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{f}: tensor {name} has unsupported dtype {dtype_name}")
                specs[name] = TensorSpec(tuple(sl.get_shape()), _SAFETENSORS_DTYPES[dtype_name])
    return specs


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


class VLLMEngine(Engine):
    """Sampling with vLLM on a GPU; same contract as TorchEngine."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "VLLMEngine needs vLLM, an optional GPU extra: pip install 'robustrl[gpu]' "
                "(on CPU hosts use TorchEngine)"
            ) from e
        self._vllm = vllm
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if not isinstance(eos, int):
            raise ValueError(f"tokenizer in {model_dir} has no eos token")
        self.eos_id: int = eos
        self.pad_id: int = pad if isinstance(pad, int) else eos
        config = AutoConfig.from_pretrained(self.model_dir)
        self.max_positions = int(config.max_position_embeddings)
        self._specs = checkpoint_specs(self.model_dir)
        self._llm = vllm.LLM(
            model=str(self.model_dir),
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            # Ignore generation_config.json defaults (top_k/top_p...): sampling is ours.
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.WorkerExtension",
            **llm_kwargs,
        )
        self.weight_version = 0
        self._lock = threading.Lock()

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
    ) -> list[list[Completion]]:
        encoded = self.encode_all(prompts, params.max_new_tokens)
        if not encoded:
            return []
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            seed=params.seed,
            logprobs=0,
            skip_special_tokens=True,
        )
        requests = [{"prompt_token_ids": ids} for ids in encoded]
        with self._lock:
            outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        completions = [
            [completion_from_output(ids, o, self.eos_id) for o in out.outputs]
            for ids, out in zip(encoded, outputs, strict=True)
        ]
        if on_tokens is not None:
            on_tokens(sum(len(c.token_ids) for group in completions for c in group))
        return completions

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        incoming = validate_weights(self._specs, named_tensors)
        weights = [(name, t.detach().cpu().contiguous()) for name, t in incoming.items()]
        with self._lock:
            self._llm.collective_rpc("robustrl_load_weights", args=(weights,))
            self.weight_version = self.weight_version + 1 if version is None else version
