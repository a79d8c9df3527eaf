"""Checkpoints with a released model's shape, made here: no model hub is reachable where
robustrl is built and tested, and what a test about real shapes needs is the architecture,
the config, the dtype on disk, tied embeddings and the vocabulary, not trained weights.

`write_like(NAME, out)` writes a Hugging Face folder with NAME's config (hidden size, layers,
heads, KV heads, vocabulary, tied embeddings, rope settings, as the release publishes them),
seeded random weights in bf16 safetensors, and a tokenizer built locally with the same
vocabulary size and special-token ids and a chat template in the family's format. The
tokenizer is byte level: every text encodes, one token a byte; the rest of the vocabulary
exists (the embedding has its rows, ids decode) but no text encodes to it. `layers` keeps the
first N layers (a shallow copy for tests). ``robustrl model init --like NAME`` calls it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's chat format: each message between <|im_start|>ROLE and <|im_end|>."""

LLAMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3's chat format: a header per message, each ended by <|eot_id|>."""


@dataclass(frozen=True)
class Family:
    """What a model family's tokenizer looks like: its special tokens at their ids."""

    regular_tokens: int
    """Tokens below the first special one."""
    specials: dict[str, int]
    bos: str | None
    eos: str
    pad: str
    chat_template: str


QWEN = Family(
    regular_tokens=151_643,
    specials={"<|endoftext|>": 151_643, "<|im_start|>": 151_644, "<|im_end|>": 151_645},
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    chat_template=CHATML,
)
LLAMA3 = Family(
    regular_tokens=128_000,
    specials={
        "<|begin_of_text|>": 128_000,
        "<|end_of_text|>": 128_001,
        "<|finetune_right_pad_id|>": 128_004,
        "<|start_header_id|>": 128_006,
        "<|end_header_id|>": 128_007,
        "<|eot_id|>": 128_009,
    },
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad="<|finetune_right_pad_id|>",
    chat_template=LLAMA3_CHAT,
)


@dataclass(frozen=True)
class RealShape:
    family: Family
    config: dict[str, Any] = field(default_factory=dict)
    """The release's config.json, as far as the architecture goes."""


LIKE: dict[str, RealShape] = {
    "qwen2.5-0.5b": RealShape(
        QWEN,
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151_936,
            "max_position_embeddings": 32_768,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "initializer_range": 0.02,
        },
    ),
    "qwen3-0.6b": RealShape(
        QWEN,
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151_936,
            "max_position_embeddings": 40_960,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
        },
    ),
    "llama-3.2-1b": RealShape(
        LLAMA3,
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128_256,
            "max_position_embeddings": 131_072,
            "rope_theta": 500_000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
        },
    ),
}


def build_tokenizer(family: Family, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with `family`'s special tokens at their ids and `vocab_size`
    tokens in all, one for each of the model's embedding rows."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    # Unreachable filler up to the first special id: the ids exist and decode.
    for i in range(len(vocab), family.regular_tokens):
        vocab[f"<|reserved_{i}|>"] = i
    last = max(family.specials.values())
    if last >= vocab_size:
        raise ValueError(f"vocabulary of {vocab_size} cannot hold special token id {last}")
    for i in range(family.regular_tokens, vocab_size):
        vocab.setdefault(f"<|reserved_{i}|>", i)
    for text, i in family.specials.items():
        del vocab[f"<|reserved_{i}|>"]
        vocab[text] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(family.specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        padding_side="left",
        model_max_length=1 << 20,
        chat_template=family.chat_template,
    )


def write_like(name: str, out_dir: str | Path, *, seed: int = 0, layers: int | None = None) -> Path:
    """Write a checkpoint shaped like `name` (one of LIKE) to `out_dir`; ValueError for an
    unknown name or a layer count the release does not have."""
    if name not in LIKE:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(sorted(LIKE))}")
    shape = LIKE[name]
    settings = dict(shape.config)
    full = int(settings["num_hidden_layers"])
    if layers is not None:
        if not 1 <= layers <= full:
            raise ValueError(f"--layers {layers}: {name} has 1 to {full} layers")
        settings["num_hidden_layers"] = layers
    family = shape.family
    tokenizer = build_tokenizer(family, int(settings["vocab_size"]))
    config = AutoConfig.for_model(
        **settings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    saved = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.random.set_rng_state(saved)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokenizer_config = out / "tokenizer_config.json"
    settings_on_disk = json.loads(tokenizer_config.read_text())
    # transformers 5 records its own backend class, which transformers 4 (vLLM hosts often
    # run it) does not know; PreTrainedTokenizerFast loads the same tokenizer.json in both.
    settings_on_disk["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(settings_on_disk, indent=2) + "\n")
    (out / "robustrl_model.json").write_text(
        json.dumps({"like": name, "seed": seed, "layers": settings["num_hidden_layers"]}) + "\n"
    )
    return out
