"""Generate the tiny policy model a job starts from, and its optional SFT warm-up.

No model hub is reachable where robustrl is built and tested, so the starting policy is made
here: a randomly initialised, seeded Qwen3-architecture causal LM with a character-level
tokenizer over the task's alphabet, saved in Hugging Face format so that
``AutoModelForCausalLM.from_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)`` (and
vLLM on GPU hosts) load it offline. The SFT warm-up teaches the answer format and some
arithmetic, deliberately not much (about 2 s of CPU), so RL starts from a policy that is
sometimes right: about 0.1-0.2 greedy accuracy on the held-out split, which GRPO lifts by
about 0.45-0.55 in 600 steps (benchmarks/grpo_recipe.py has the measured curve).

``robustrl model init`` calls :func:`init_model` (and :func:`sft_warmup`);
``python -m robustrl.generation.modelgen --out DIR`` does the same from a shell.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from robustrl.generation.tasks import TaskItem, get_task

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


@dataclass(frozen=True)
class ModelShape:
    """Size of the generated model (about 300k parameters with the defaults).

    The defaults are the recipe measured in benchmarks/grpo_recipe.py: heads of 32 dimensions
    (vLLM's CPU attention refuses 16), and at this size the model learns two-digit addition
    within a few hundred RL steps (docs/decisions/0401-tiny-model-shape.md).
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 128


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per alphabet character plus pad/bos/eos/unk.

    Encoding prepends ``<bos>``; decoding joins characters without spaces.
    """
    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("tokenizer alphabet is empty")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        if ch in vocab:
            raise ValueError(f"alphabet character {ch!r} collides with a special token")
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        # Batched prompts are left-padded so every row's next token sits at the same column.
        padding_side="left",
        model_max_length=1 << 20,
    )


def init_model(
    out_dir: str | Path,
    seed: int,
    *,
    task: str = "arithmetic",
    shape: ModelShape | None = None,
) -> Path:
    """Write a seeded, randomly initialised Qwen3 model and its tokenizer to ``out_dir``.

    The same (seed, task, shape) always writes the same weights.
    """
    shape = shape or ModelShape()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(get_task(task).alphabet)
    if shape.hidden_size % shape.num_heads:
        raise ValueError(
            f"hidden_size {shape.hidden_size} not divisible by {shape.num_heads} heads"
        )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        # Untied, so every parameter has exactly one name in a weight manifest.
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with _seeded(seed):
        model = Qwen3ForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out)
    (out / "robustrl_model.json").write_text(
        json.dumps({"task": task, "seed": seed, "shape": asdict(shape)}, indent=2) + "\n"
    )
    return out


def _portable_tokenizer_class(model_dir: Path) -> None:
    # transformers 5 records its own backend class name, which transformers 4 (what vLLM
    # hosts often run) does not know; PreTrainedTokenizerFast loads the same tokenizer.json
    # under both.
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


class _seeded:
    """Seed torch's global RNG for a block and put the previous state back afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.saved: torch.Tensor | None = None

    def __enter__(self) -> None:
        self.saved = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        torch.random.set_rng_state(self.saved)


@dataclass(frozen=True)
class SFTConfig:
    """The SFT warm-up. Deliberately weak: 150 steps of 32 examples leave the policy right on
    roughly one held-out prompt in six, with the right answer often among its samples."""

    steps: int = 150
    lr: float = 3e-3
    batch_size: int = 32
    num_examples: int = 4096
    """Training rows the warm-up draws its batches from."""
    seed: int = 0


@dataclass(frozen=True)
class SFTResult:
    steps: int
    final_loss: float
    seconds: float


def sft_batch(
    tokenizer: PreTrainedTokenizerBase, items: list[TaskItem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos> prompt answer <eos>`` rows; labels cover only answer and eos.

    Returns (input_ids, attention_mask, labels) with -100 where no loss is taken.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    assert isinstance(eos, int) and isinstance(pad, int)
    rows: list[tuple[list[int], int]] = []
    for item in items:
        prompt_ids = tokenizer(item.prompt)["input_ids"]
        answer_ids = tokenizer(item.answer, add_special_tokens=False)["input_ids"]
        rows.append((list(prompt_ids) + list(answer_ids) + [eos], len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids, mask, labels


def sft_warmup(
    model_dir: str | Path,
    config: SFTConfig | None = None,
    *,
    task: str = "arithmetic",
    log_every: int = 20,
) -> SFTResult:
    """Fine-tune the model in ``model_dir`` on the task's training data and save it in place."""
    config = config or SFTConfig()
    model_dir = Path(model_dir)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    data = get_task(task).generate(config.num_examples, config.seed)
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    loss_value = float("nan")
    with _seeded(config.seed):
        for step in range(1, config.steps + 1):
            batch = [rng.choice(data) for _ in range(config.batch_size)]
            input_ids, mask, labels = sft_batch(tokenizer, batch)
            out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = float(out.loss.detach())
            if log_every and (step % log_every == 0 or step == config.steps):
                print(f"sft step {step}/{config.steps} loss {loss_value:.4f}", flush=True)
    model.eval()
    model.save_pretrained(model_dir)
    return SFTResult(steps=config.steps, final_loss=loss_value, seconds=time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m robustrl.generation.modelgen",
        description="Generate a tiny Qwen3-architecture policy (HF format) for a built-in task.",
    )
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="arithmetic")
    defaults = ModelShape()
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument(
        "--intermediate-size", type=int, default=0, help="MLP width (default: 2 x hidden size)"
    )
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument(
        "--sft-steps", type=int, default=SFTConfig.steps, help="0 skips the SFT warm-up"
    )
    parser.add_argument("--sft-lr", type=float, default=SFTConfig.lr)
    parser.add_argument("--sft-examples", type=int, default=SFTConfig.num_examples)
    args = parser.parse_args(argv)
    shape = ModelShape(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 2 * args.hidden_size,
        num_layers=args.layers,
        num_heads=defaults.num_heads,
        num_kv_heads=defaults.num_kv_heads,
        max_position_embeddings=defaults.max_position_embeddings,
    )
    started = time.monotonic()
    out = init_model(args.out, args.seed, task=args.task, shape=shape)
    print(f"model written to {out} ({time.monotonic() - started:.1f}s)", flush=True)
    if args.sft_steps > 0:
        sft = SFTConfig(
            steps=args.sft_steps, lr=args.sft_lr, num_examples=args.sft_examples, seed=args.seed
        )
        result = sft_warmup(out, sft, task=args.task)
        print(
            f"sft warm-up: {result.steps} steps, loss {result.final_loss:.4f}, "
            f"{result.seconds:.1f}s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
