"""The torch engine samples what it says it samples, and swaps weights all-or-nothing."""

from __future__ import annotations

import inspect
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from robustrl.generation.engine import (
    ContextExceeded,
    SamplingParams,
    TorchEngine,
    cache_keyword,
)
from robustrl.generation.modelgen import init_model
from services.trainer.grpo import Sample, completion_logprobs
from tests.support.reference import full_forward_logprobs
from tests.support.tiny_model import TINY

PROMPTS = ["3+4=", "12+17=", "1+1=", "19+13="]


@pytest.fixture
def engine(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_full_forward_of_the_same_tokens(
    engine: TorchEngine, temperature: float
) -> None:
    groups = engine.generate(
        PROMPTS, SamplingParams(n=3, temperature=temperature, max_new_tokens=6, seed=3)
    )
    completions = [c for g in groups for c in g]
    assert len(completions) == len(PROMPTS) * 3
    for c in completions:
        ref = full_forward_logprobs(engine, c.prompt_ids, c.token_ids, temperature)
        assert c.logprobs == pytest.approx(ref, abs=1e-5)
    # The trainer's batched recomputation agrees too: ratio 1 on policy.
    samples = [Sample(c.prompt_ids, c.token_ids, c.logprobs, 0.0) for c in completions]
    trainer_lp = completion_logprobs(engine.model, samples, engine.pad_id, temperature)
    for c, lp in zip(completions, trainer_lp, strict=True):
        assert lp == pytest.approx(c.logprobs, abs=1e-5)


def test_greedy_takes_the_argmax(engine: TorchEngine) -> None:
    groups = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    for group in groups:
        c = group[0]
        ids = list(c.prompt_ids)
        for tok in c.token_ids:
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert tok == int(logits.argmax())
            ids.append(tok)


@pytest.mark.filterwarnings("error::FutureWarning")
def test_generation_passes_the_kv_cache_by_the_models_own_keyword(engine: TorchEngine) -> None:
    """transformers 5 takes the cache as `cache` and deprecates `past_key_values` (removed in
    5.40): the engine asks the model class which it takes, so generating warns of nothing
    (the deprecation warning fails this test) and keeps working past that release."""
    forward = inspect.signature(type(engine.model).forward).parameters
    assert cache_keyword(engine.model) == ("cache" if "cache" in forward else "past_key_values")
    [group] = engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=4))
    assert all(len(c.token_ids) >= 1 for c in group)


def test_sampling_is_seeded(engine: TorchEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=11)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    other = engine.generate(
        PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=12)
    )
    assert other != first


def test_finish_reasons_and_lengths(engine: TorchEngine) -> None:
    groups = engine.generate(PROMPTS, SamplingParams(n=8, temperature=1.5, max_new_tokens=4))
    for group in groups:
        for c in group:
            assert len(c.logprobs) == len(c.token_ids)
            assert engine.eos_id not in c.token_ids[:-1]
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == engine.eos_id
            else:
                assert len(c.token_ids) == 4 and c.token_ids[-1] != engine.eos_id


def test_stops_at_eos(engine: TorchEngine) -> None:
    _eos_loving_head(engine)
    groups = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5))
    for group in groups:
        for c in group:
            assert c.token_ids == [engine.eos_id]
            assert c.finish_reason == "stop"
            assert c.text == ""


def _eos_loving_head(engine: TorchEngine, eos_bias: float = 50.0) -> None:
    """An output head that strongly prefers eos whatever the hidden state."""
    config: Any = engine.model.config
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-eos_bias)
        head.bias[engine.eos_id] = eos_bias
    engine.model.lm_head = head


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_on_tokens_hears_of_every_decode_step_as_it_happens(
    engine: TorchEngine, temperature: float
) -> None:
    calls: list[int] = []

    def on_tokens(count: int) -> None:
        # Called from inside generate(), which holds the engine for the whole call.
        assert engine._lock.locked()
        calls.append(count)

    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=6, seed=2)
    completions = [c for g in engine.generate(PROMPTS, params, on_tokens) for c in g]
    lengths = [len(c.token_ids) for c in completions]
    # One call per decode step, each counting the completions that got a token in that step.
    assert calls == [sum(n > t for n in lengths) for t in range(max(lengths))]
    assert sum(calls) == sum(lengths)


def test_min_new_tokens_holds_eos_back_until_then(engine: TorchEngine) -> None:
    _eos_loving_head(engine)
    groups = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, min_new_tokens=2)
    )
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == 3 and c.token_ids[-1] == engine.eos_id, c.token_ids
        assert engine.eos_id not in c.token_ids[:2]
        assert c.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_long_tail_generates_exactly_max_new_tokens_times_the_factor(
    engine: TorchEngine, temperature: float
) -> None:
    # What a rollout asks for a long-tail group: max_new_tokens x factor, eos held back.
    # An eos-loving model would otherwise stop at the first token.
    _eos_loving_head(engine, eos_bias=5.0)
    length = 2 * 8
    calls: list[int] = []
    params = SamplingParams(
        n=2, temperature=temperature, max_new_tokens=length, min_new_tokens=length, seed=4
    )
    groups = engine.generate(PROMPTS[:2], params, calls.append)
    assert calls == [2 * 2] * length  # factor x as many decode steps, every row in each
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == length and engine.eos_id not in c.token_ids
        assert c.finish_reason == "length"
        # The reported logprobs are the model's own (eos not masked): what the trainer
        # recomputes, so the ratio stays 1 on policy.
        ref = full_forward_logprobs(engine, c.prompt_ids, c.token_ids, temperature)
        assert c.logprobs == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_non_finite_logits_end_the_row_and_are_reported_not_raised(
    engine: TorchEngine, temperature: float
) -> None:
    config: Any = engine.model.config
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    with torch.no_grad():
        head.bias.fill_(float("nan"))
    engine.model.lm_head = head
    groups = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=4)
    )
    for c in (c for g in groups for c in g):
        assert c.token_ids == [engine.eos_id] and c.finish_reason == "stop"
        assert len(c.logprobs) == 1 and math.isnan(c.logprobs[0])


def test_rejects_a_prompt_longer_than_the_context(engine: TorchEngine) -> None:
    limit = TINY.max_position_embeddings - 8  # tokens a prompt may have with 8 new tokens
    fits = "1" * (limit - 1)  # plus bos
    engine.generate([fits], SamplingParams(max_new_tokens=8))
    # The job's input, not a fault of the machine: a trainer that meets it fails the job.
    with pytest.raises(ContextExceeded, match="exceeds the context") as raised:
        engine.generate([fits, fits + "1"], SamplingParams(max_new_tokens=8))
    assert raised.value.index == 1  # which prompt of the batch: the rollout names its row


def test_bad_sampling_params_are_rejected() -> None:
    with pytest.raises(ValueError):
        SamplingParams(n=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    assert SamplingParams(max_new_tokens=4, min_new_tokens=4).min_new_tokens == 4


def _other_weights(tiny_model_dir: Path, tmp_path: Path) -> TorchEngine:
    init_model(tmp_path / "other", seed=1, shape=TINY)
    return TorchEngine.from_pretrained(tmp_path / "other")


def test_load_weights_swaps_the_whole_model(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = _other_weights(tiny_model_dir, tmp_path)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=5)
    assert engine.generate(PROMPTS, params) != other.generate(PROMPTS, params)
    engine.load_weights(other.model.state_dict().items(), version=7)
    assert engine.weight_version == 7
    assert engine.generate(PROMPTS, params) == other.generate(PROMPTS, params)
    engine.load_weights(other.model.state_dict().items())
    assert engine.weight_version == 8


@pytest.mark.parametrize("fault", ["shape", "dtype", "missing", "unknown", "duplicate"])
def test_load_weights_rejects_a_mismatch_and_changes_nothing(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path, fault: str
) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    update = list(_other_weights(tiny_model_dir, tmp_path).model.state_dict().items())
    # The bad tensor comes last, so a non-atomic loader would already have copied the rest.
    name, tensor = update[-1]
    if fault == "shape":
        update[-1] = (name, tensor[:-1])
    elif fault == "dtype":
        update[-1] = (name, tensor.double())
    elif fault == "missing":
        update.pop()
    elif fault == "unknown":
        update.append(("model.layers.9.mlp.up_proj.weight", tensor))
    else:
        update.append(update[0])
    with pytest.raises(ValueError, match="model unchanged"):
        engine.load_weights(update, version=3)
    assert engine.weight_version == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_weight_swap_waits_for_the_generation_in_progress(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = _other_weights(tiny_model_dir, tmp_path)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=5)
    expected_old = engine.generate(PROMPTS, params)
    started, release = threading.Event(), threading.Event()
    real_forward = engine.model.forward
    calls = 0

    def slow_forward(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 2:  # inside the decode loop: the first step was sampled with old weights
            started.set()
            release.wait(5)
        return real_forward(*args, **kwargs)

    engine.model.forward = slow_forward
    result: list[object] = []
    gen = threading.Thread(target=lambda: result.append(engine.generate(PROMPTS, params)))
    gen.start()
    assert started.wait(5)
    swap = threading.Thread(target=lambda: engine.load_weights(other.model.state_dict().items()))
    swap.start()
    swap.join(0.2)
    assert swap.is_alive(), "load_weights must wait for the generate() in progress"
    release.set()
    gen.join(5)
    swap.join(5)
    engine.model.forward = real_forward
    assert result == [expected_old]
    assert engine.weight_version == 1


# --- vLLM engine ------------------------------------------------------------------------


def test_vllm_weight_specs_come_from_the_checkpoint_header(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    from robustrl.generation.serving import checkpoint_specs

    assert checkpoint_specs(tiny_model_dir) == engine.weight_specs()


def test_vllm_outputs_convert_to_completions() -> None:
    from robustrl.generation.vllm_engine import completion_from_output

    def lp(x: float) -> SimpleNamespace:
        return SimpleNamespace(logprob=x)

    stopped = SimpleNamespace(
        token_ids=[7, 2],
        logprobs=[{7: lp(-0.5), 3: lp(-2.0)}, {2: lp(-0.1)}],
        finish_reason="stop",
        text="4",
    )
    c = completion_from_output([1, 5], stopped, eos_id=2)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.text) == ([7, 2], [-0.5, -0.1], "stop", "4")
    cut = SimpleNamespace(token_ids=[7], logprobs=[{7: lp(-0.5)}], finish_reason="length", text="4")
    assert completion_from_output([1], cut, eos_id=2).finish_reason == "length"
    missing = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="length", text="4")
    with pytest.raises(RuntimeError, match="logprobs"):
        completion_from_output([1], missing, eos_id=2)


@pytest.mark.gpu
def test_vllm_engine_matches_the_torch_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    from robustrl.generation.vllm_engine import VLLMEngine

    reference = TorchEngine.from_pretrained(tiny_model_dir)
    vllm = VLLMEngine(
        tiny_model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True
    )
    groups = vllm.generate(PROMPTS, SamplingParams(n=3, temperature=0.8, max_new_tokens=6, seed=1))
    for c in (c for g in groups for c in g):
        ref = full_forward_logprobs(reference, c.prompt_ids, c.token_ids, 0.8)
        assert c.logprobs == pytest.approx(ref, abs=1e-3)
    other = _other_weights(tiny_model_dir, tmp_path)
    vllm.load_weights(other.model.state_dict().items(), version=4)
    assert vllm.weight_version == 4
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    got = [g[0].token_ids for g in vllm.generate(PROMPTS, greedy)]
    assert got == [g[0].token_ids for g in other.generate(PROMPTS, greedy)]
    with pytest.raises(ValueError, match="model unchanged"):
        vllm.load_weights(list(other.model.state_dict().items())[:-1])
