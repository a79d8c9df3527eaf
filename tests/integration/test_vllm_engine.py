"""The vLLM engine for real, on CPU with vLLM's CPU build; on a CUDA host with vLLM's CUDA build
these are `gpu` tests (tests/conftest.py) and run the same on the GPU:
the same samples and logprobs as the torch engine, tokens reported as they stream out, and
weights that reach it over the UCX plane only whole and verified."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from robustrl.contracts.keys import KeySpace
from robustrl.core.processes import descendants, process_name, running
from robustrl.generation.engine import Completion, SamplingParams, SourceGone, TorchEngine
from robustrl.generation.modelgen import ModelShape, init_model
from robustrl.generation.vllm_engine import EngineStartError, VLLMEngine
from robustrl.weights.ucx.holder import HolderFaults
from robustrl.weights.ucx.transport import UcxTransport
from tests.support import eventually
from tests.support.reference import full_forward_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["3+4=", "12+17=", "1+1=", "19+13=", "40+2="]
KV_CACHE = 32 << 20
LOGPROB_TOLERANCE = 1e-4
"""Both engines compute in fp32; the same tokens' logprobs differ by ~4e-7 here."""


def perturbed(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of the model whose every weight moved by seeded noise: other weights, same
    names, shapes and dtypes."""
    shutil.copytree(model_dir, out)
    reference = TorchEngine.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator)).contiguous()
        for name, t in reference.model.state_dict().items()
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def other_weights(model_dir: Path, out: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The weights of `perturbed(model_dir, out, seed)`, as a trainer would publish them."""
    other = TorchEngine.from_pretrained(perturbed(model_dir, out, seed))
    return list(other.model.state_dict().items())


UPDATE_SAMPLING = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=4)
"""How the weight-update test samples: seeded, so the same weights give the same samples."""


@dataclass(frozen=True)
class Started:
    engine: VLLMEngine
    fresh: list[list[Completion]]
    """Its UPDATE_SAMPLING outputs right after its start, on the weights read from disk."""


@pytest.fixture(scope="module")
def started(model_dir: Path) -> Iterator[Started]:
    """The one engine of this file (a vLLM start costs the better part of a minute here). Its
    last user, test_the_engine_runs_its_own_processes_and_leaves_none_behind, closes it."""
    engine = VLLMEngine(model_dir, kv_cache_bytes=KV_CACHE)
    try:
        yield Started(engine, engine.generate(PROMPTS, UPDATE_SAMPLING))
    finally:
        engine.close()


@pytest.fixture
def vllm(started: Started) -> VLLMEngine:
    # pytest runs a file's tests in their order (and `--dist loadfile` a file on one worker):
    # every test using the engine comes before the one that closes it.
    assert started.engine.engine_pids(), "the module's engine was closed before this test"
    return started.engine


@pytest.fixture
def original(vllm: VLLMEngine, model_dir: Path) -> Iterator[TorchEngine]:
    """The model as on disk; put back into the shared engine after the test."""
    reference = TorchEngine.from_pretrained(model_dir)
    yield reference
    vllm.load_weights(reference.model.state_dict().items(), version=0)


@pytest.fixture
async def holder(etcd_client: Any, etcd_settings: Any) -> AsyncIterator[Any]:
    """Make a UCX holder in this process (as a rollout holds what it pulled): holder(faults)."""
    made: list[UcxTransport] = []

    async def make(faults: HolderFaults | None = None, keep_versions: int = 2) -> UcxTransport:
        transport = UcxTransport(
            etcd_client,
            KeySpace(etcd_settings.prefix),
            "vj",
            instance_id=f"holder-{len(made)}",
            relay=False,
            bucket_bytes=16 << 10,  # the tiny model in a few dozen buckets
            faults=faults,
            keep_versions=keep_versions,
        )
        await transport.start()
        made.append(transport)
        return transport

    yield make
    for transport in made:
        await transport.close()


def test_greedy_completions_are_the_torch_engines(vllm: VLLMEngine, original: TorchEngine) -> None:
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)

    got = vllm.generate(PROMPTS, greedy)
    expected = original.generate(PROMPTS, greedy)

    for mine, theirs in zip(got, expected, strict=True):
        assert [c.token_ids for c in mine] == [c.token_ids for c in theirs]
        for a, b in zip(mine, theirs, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE)
            assert (a.finish_reason, a.text) == (b.finish_reason, b.text)


def test_sampled_logprobs_are_those_the_trainer_recomputes(
    vllm: VLLMEngine, original: TorchEngine
) -> None:
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=6, seed=1)

    groups = vllm.generate(PROMPTS, params)

    assert [len(g) for g in groups] == [4] * len(PROMPTS)
    for completion in (c for g in groups for c in g):
        expected = full_forward_logprobs(original, completion.prompt_ids, completion.token_ids, 0.8)
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    # Same seed, prompts, params and weights: the same samples.
    assert vllm.generate(PROMPTS, params) == groups


def test_tokens_are_reported_as_they_stream_out(vllm: VLLMEngine) -> None:
    heard: list[int] = []
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, min_new_tokens=24, seed=2)

    groups = vllm.generate(PROMPTS[:2], params, heard.append)

    assert sum(heard) == sum(len(c.token_ids) for g in groups for c in g) == 2 * 3 * 24
    assert len(heard) >= 24  # step by step, not once at the end


async def test_a_weight_update_over_ucx_gives_the_outputs_of_those_weights_loaded_fresh(
    vllm: VLLMEngine,
    started: Started,
    original: TorchEngine,
    holder: Any,
    model_dir: Path,
    tmp_path: Path,
) -> None:
    params = UPDATE_SAMPLING
    before = vllm.generate(PROMPTS, params)
    weights = other_weights(model_dir, tmp_path / "other", seed=3)
    transport = await holder()
    await transport.publish(5, weights)
    source = transport.local_source(5)
    assert source is not None and source.version == 5

    await asyncio.to_thread(vllm.load_weights, weights, 5, source)

    assert vllm.weight_version == 5
    assert transport.counters.buckets_served > 1  # the engine's worker copied it over UCX
    updated = vllm.generate(PROMPTS, params)
    assert updated != before
    # Every token's logprob is the one the other weights give in torch, which the engine's
    # outputs on weights it loads from disk equal (the tests above): no tensor was left out,
    # misplaced or half copied.
    other = TorchEngine.from_pretrained(tmp_path / "other")
    for completion in (c for g in updated for c in g):
        expected = full_forward_logprobs(other, completion.prompt_ids, completion.token_ids, 1.0)
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    assert [[c.token_ids for c in g] for g in vllm.generate(PROMPTS, greedy)] == [
        [c.token_ids for c in g] for g in other.generate(PROMPTS, greedy)
    ]

    # The weights on disk, back over UCX: the samples of the engine as it started on them,
    # fresh from disk, to the token (a seeded sample follows every bit of the weights).
    on_disk = list(original.model.state_dict().items())
    await transport.publish(6, on_disk)
    source = transport.local_source(6)
    assert source is not None and source.version == 6
    served = transport.counters.buckets_served

    await asyncio.to_thread(vllm.load_weights, on_disk, 6, source)

    assert vllm.weight_version == 6
    assert transport.counters.buckets_served > served + 1
    back = vllm.generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in back] == [
        [c.token_ids for c in g] for g in started.fresh
    ]
    for a, b in zip(
        (c for g in back for c in g), (c for g in started.fresh for c in g), strict=True
    ):
        assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE)


async def test_a_corrupt_bucket_never_reaches_the_engine(
    vllm: VLLMEngine, original: TorchEngine, holder: Any, model_dir: Path, tmp_path: Path
) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = vllm.generate(PROMPTS, greedy)
    weights = other_weights(model_dir, tmp_path / "other", seed=5)
    transport = await holder(HolderFaults(corrupt_buckets=frozenset({1})))
    await transport.publish(6, weights)

    with pytest.raises(Exception, match="do not match the manifest"):
        await asyncio.to_thread(vllm.load_weights, weights, 6, transport.local_source(6))

    assert vllm.weight_version == 0
    assert vllm.generate(PROMPTS, greedy) == before


async def test_a_holder_gone_mid_copy_never_reaches_the_engine(
    vllm: VLLMEngine, original: TorchEngine, holder: Any, model_dir: Path, tmp_path: Path
) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = vllm.generate(PROMPTS, greedy)
    weights = other_weights(model_dir, tmp_path / "other", seed=6)
    transport = await holder(HolderFaults(stall_after_buckets=3))
    await transport.publish(7, weights)
    source = transport.local_source(7)

    loading = asyncio.ensure_future(asyncio.to_thread(vllm.load_weights, weights, 7, source))

    async def stalled() -> bool:
        return transport.counters.buckets_served >= 3

    await eventually(stalled, timeout=60)
    await transport.close()  # the holder goes away with the copy half done
    with pytest.raises(Exception, match=r"copy of version 7 from .* failed after \d+ of \d+ bytes"):
        await loading
    assert vllm.weight_version == 0
    assert vllm.generate(PROMPTS, greedy) == before


async def test_a_version_its_holder_dropped_meanwhile_is_source_gone_and_loads_nothing(
    vllm: VLLMEngine, holder: Any, model_dir: Path, tmp_path: Path
) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = vllm.generate(PROMPTS, greedy)
    weights = other_weights(model_dir, tmp_path / "other", seed=7)
    transport = await holder(keep_versions=1)
    await transport.publish(8, weights)
    source = transport.local_source(8)
    await transport.publish(9, weights)  # v8 superseded and dropped, as a rollout's are

    with pytest.raises(SourceGone, match="version 8"):
        await asyncio.to_thread(vllm.load_weights, weights, 8, source)

    assert vllm.weight_version == 0
    assert vllm.generate(PROMPTS, greedy) == before


def test_an_update_with_a_missing_tensor_is_refused_before_anything_is_sent(
    vllm: VLLMEngine, original: TorchEngine
) -> None:
    weights = list(original.model.state_dict().items())

    with pytest.raises(ValueError, match=r"model unchanged: missing: lm_head\.weight"):
        vllm.load_weights([w for w in weights if w[0] != "lm_head.weight"], version=9)

    assert vllm.weight_version == 0


def test_the_engine_runs_its_own_processes_and_leaves_none_behind(started: Started) -> None:
    # The module's engine, after all it served above: this test closes it, so it comes after
    # every test that uses it.
    engine = started.engine
    pids = engine.engine_pids()
    try:
        assert len(pids) >= 1
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids]
        assert names[0].startswith("VLLM::EngineCor"), names
    finally:
        engine.close()
    # a pid the system gave to another process since carries another name
    assert not [pid for pid in pids if running(pid) and process_name(pid).startswith("VLLM::")]
    assert engine.engine_pids() == []


def test_an_unreadable_checkpoint_is_refused_before_vllm_starts(
    model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = _engine_processes()

    with pytest.raises(ValueError, match="not a readable safetensors file"):
        VLLMEngine(broken, kv_cache_bytes=KV_CACHE)

    assert _engine_processes() == before


def test_a_model_vllm_cannot_load_fails_to_start_and_leaves_nothing_running(
    model_dir: Path, tmp_path: Path
) -> None:
    unknown = tmp_path / "unknown"
    shutil.copytree(model_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    before = _engine_processes()

    with pytest.raises(EngineStartError, match=r"vLLM could not start .*NoSuchModelForCausalLM"):
        VLLMEngine(unknown, kv_cache_bytes=KV_CACHE)

    assert _engine_processes() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention refuses it, CUDA's not")
def test_a_model_vllms_engine_core_refuses_fails_to_start_naming_the_cause(tmp_path: Path) -> None:
    # Heads of 16 dimensions: the torch engine runs them, vLLM's CPU attention does not, and
    # says so only in its engine core's process.
    narrow = init_model(
        tmp_path / "narrow",
        seed=0,
        shape=ModelShape(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2),
    )
    before = _engine_processes()

    with pytest.raises(
        EngineStartError, match=r"vLLM could not start .*Unsupported CPU attention.*head_dim=16"
    ) as info:
        VLLMEngine(narrow, kv_cache_bytes=KV_CACHE)

    assert "See root cause above" not in str(info.value)
    assert _engine_processes() == before


def _engine_processes() -> list[int]:
    """vLLM's processes below this one."""
    return [pid for pid in descendants(os.getpid()) if process_name(pid).startswith("VLLM::")]


def test_importing_the_engine_module_imports_no_vllm() -> None:
    code = (
        "import sys; import robustrl.generation.vllm_engine; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]"
