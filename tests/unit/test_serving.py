"""A checkpoint shaped like a release (`model init --like`), and the serving form a trainer
publishes it in: the checkpoint's names and dtypes, a tied matrix once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from robustrl.generation.engine import SamplingParams, TorchEngine
from robustrl.generation.real_shapes import LIKE, build_tokenizer, write_like
from robustrl.generation.serving import checkpoint_specs, distinct_tensors, serving_state

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def master(like_model_dir: Path) -> torch.nn.Module:
    """The checkpoint as a trainer holds it: fp32 master weights."""
    return AutoModelForCausalLM.from_pretrained(like_model_dir, dtype=torch.float32)


def test_the_like_checkpoint_has_the_release_shape_bf16_tied_and_its_vocabulary(
    like_model_dir: Path,
) -> None:
    config = AutoConfig.from_pretrained(like_model_dir)
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert (config.hidden_size, config.intermediate_size) == (896, 4864)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert config.vocab_size == 151_936 and config.tie_word_embeddings
    assert config.num_hidden_layers == 2
    specs = checkpoint_specs(like_model_dir)
    assert {s.dtype for s in specs.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in specs  # tied: saved once, as the embedding
    assert specs[EMBED].shape == (151_936, 896)
    tokenizer = AutoTokenizer.from_pretrained(like_model_dir)
    assert len(tokenizer) == 151_936
    assert tokenizer.convert_ids_to_tokens([151_643, 151_644, 151_645]) == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151_645, 151_643)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+30? ü"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>user\nWhat is 12+30? ü<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 151_644 and tokenizer.decode(ids) == text  # every byte encodes


def test_the_like_configs_follow_the_releases() -> None:
    llama = LIKE["llama-3.2-1b"].config
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["vocab_size"]) == (
        2048,
        16,
        128_256,
    )
    assert llama["rope_scaling"]["rope_type"] == "llama3" and llama["tie_word_embeddings"]
    qwen3 = LIKE["qwen3-0.6b"].config
    assert (qwen3["hidden_size"], qwen3["num_hidden_layers"], qwen3["head_dim"]) == (1024, 28, 128)
    tokenizer = build_tokenizer(LIKE["llama-3.2-1b"].family, 128_256)
    assert len(tokenizer) == 128_256
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (128_000, 128_009)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize(
    ("name", "layers", "why"),
    [("qwen9-1t", None, "unknown model 'qwen9-1t'"), ("qwen3-0.6b", 29, "1 to 28 layers")],
)
def test_an_unknown_release_or_layer_count_is_refused_and_nothing_written(
    tmp_path: Path, name: str, layers: int | None, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        write_like(name, tmp_path / "out", layers=layers)
    assert not (tmp_path / "out").exists()


def test_the_serving_form_is_the_checkpoints_names_and_dtypes_a_tied_matrix_once(
    like_model_dir: Path, master: torch.nn.Module
) -> None:
    form = checkpoint_specs(like_model_dir)
    names = list(master.state_dict())
    assert "lm_head.weight" in names  # the model names the tied matrix twice ...
    state = serving_state(master, form)
    assert [n for n, _ in state] == [n for n in names if n != "lm_head.weight"]  # ... once here
    assert {n: (tuple(t.shape), t.dtype) for n, t in state} == {
        n: (s.shape, s.dtype) for n, s in form.items()
    }
    parameters = sum(p.numel() for p in master.parameters())  # a tied one counted once
    assert sum(t.numel() * t.element_size() for _, t in state) == 2 * parameters
    # The fp32 master stays fp32; the published tensor is its bf16 rounding.
    embed = dict(state)[EMBED]
    assert master.get_parameter(EMBED).dtype == torch.float32
    assert torch.equal(embed, master.get_parameter(EMBED).detach().to(torch.bfloat16))


def test_a_model_that_is_not_its_checkpoints_is_named_tensor_by_tensor(
    like_model_dir: Path, master: torch.nn.Module
) -> None:
    form = dict(checkpoint_specs(like_model_dir))
    norm = form.pop("model.norm.weight")
    with pytest.raises(
        ValueError, match=r"the model has tensors the checkpoint lacks: model\.norm"
    ):
        serving_state(master, form)
    form["model.norm.weight"] = type(norm)((7,), norm.dtype)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(896,\), the checkpoint's"):
        serving_state(master, form)


def test_distinct_tensors_keeps_the_first_name_of_a_shared_storage() -> None:
    a, b = torch.zeros(3), torch.ones(3)
    assert [n for n, _ in distinct_tensors([("a", a), ("b", b), ("tied", a)])] == ["a", "b"]
    view = a[1:]  # the same storage at another offset is another tensor
    assert [n for n, _ in distinct_tensors([("a", a), ("v", view)])] == ["a", "v"]


def test_the_torch_engine_runs_the_checkpoint_in_bf16_and_loads_its_serving_form(
    like_model_dir: Path, master: torch.nn.Module
) -> None:
    engine = TorchEngine.from_pretrained(like_model_dir)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    form = checkpoint_specs(like_model_dir)
    assert engine.weight_specs() == form
    moved = AutoModelForCausalLM.from_pretrained(like_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.5)
    engine.load_weights(serving_state(moved, form), version=3)
    assert engine.weight_version == 3
    head, embed = engine.model.get_parameter("lm_head.weight"), engine.model.get_parameter(EMBED)
    assert head.data_ptr() == embed.data_ptr()  # still tied, so the head moved too
    assert torch.equal(embed, moved.get_parameter(EMBED).detach().to(torch.bfloat16))
    [group] = engine.generate(["hi"], SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
    assert all(len(c.token_ids) == 3 for c in group)
    # fp32 tensors are refused by name, and nothing changes.
    fp32 = [(n, t.float()) for n, t in serving_state(moved, form)]
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: dtype torch\.float32"):
        engine.load_weights(fp32)
    assert engine.weight_version == 3


def test_model_init_like_writes_what_its_manifest_says(like_model_dir: Path) -> None:
    record = json.loads((like_model_dir / "robustrl_model.json").read_text())
    assert record == {"like": "qwen2.5-0.5b", "seed": 0, "layers": 2}
