"""The generated model and tokenizer load offline with plain transformers, and SFT teaches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from robustrl.generation.modelgen import (
    SFTConfig,
    build_tokenizer,
    init_model,
    main,
    sft_batch,
    sft_warmup,
)
from robustrl.generation.tasks import UnknownTaskError, get_task
from tests.support.tiny_model import TINY


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_writes_a_loadable_hugging_face_model(tmp_path: Path) -> None:
    out = init_model(tmp_path / "m", seed=0, shape=TINY)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["hidden_size"] == 16 and config["num_hidden_layers"] == 1
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 6, len(tok))
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id


def test_tokenizer_covers_the_task_alphabet_character_by_character() -> None:
    alphabet = get_task("arithmetic").alphabet
    tok = build_tokenizer(alphabet)
    ids = tok(alphabet, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(alphabet)
    assert tok.unk_token_id not in ids
    assert len(set(ids)) == len(alphabet)
    assert tok.decode(ids) == alphabet
    text = "19+13=32"
    with_eos = tok(text)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(with_eos, skip_special_tokens=True) == text
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = load_file(str(init_model(tmp_path / "a", seed=3, shape=TINY) / "model.safetensors"))
    b = load_file(str(init_model(tmp_path / "b", seed=3, shape=TINY) / "model.safetensors"))
    c = load_file(str(init_model(tmp_path / "c", seed=4, shape=TINY) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_init_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(42)
    expected = torch.rand(2)
    torch.manual_seed(42)
    init_model(tmp_path / "m", seed=0, shape=TINY)
    assert torch.equal(torch.rand(2), expected)


def test_unknown_task(tmp_path: Path) -> None:
    with pytest.raises(UnknownTaskError):
        init_model(tmp_path / "m", seed=0, task="chess", shape=TINY)


def test_sft_batch_supervises_only_the_answer(tmp_path: Path) -> None:
    tok = build_tokenizer(get_task("arithmetic").alphabet)
    items = get_task("arithmetic").generate(2, 0)
    _, mask, labels = sft_batch(tok, items)
    for row, item in enumerate(items):
        n_prompt = len(tok(item.prompt)["input_ids"])
        supervised = labels[row][labels[row] != -100].tolist()
        answer = tok(item.answer, add_special_tokens=False)["input_ids"]
        assert supervised == [*answer, tok.eos_token_id]
        assert labels[row, :n_prompt].eq(-100).all()
        assert int(mask[row].sum()) == n_prompt + len(answer) + 1


def _answer_loss(model_dir: Path) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    input_ids, mask, labels = sft_batch(tok, get_task("arithmetic").generate(64, 99))
    with torch.no_grad():
        return float(model(input_ids=input_ids, attention_mask=mask, labels=labels).loss)


def test_sft_warmup_lowers_the_answer_loss(tmp_path: Path) -> None:
    out = init_model(tmp_path / "m", seed=0, shape=TINY)
    before = _answer_loss(out)
    result = sft_warmup(out, SFTConfig(steps=40, lr=1e-2, batch_size=16), log_every=0)
    after = _answer_loss(out)
    assert result.steps == 40
    assert after < before - 0.5


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["--out", str(out), "--hidden-size", "16", "--layers", "1", "--sft-steps", "3"]
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "model written" in printed and "sft warm-up: 3 steps" in printed
