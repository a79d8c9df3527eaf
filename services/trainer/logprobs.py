"""The trainer's logprobs of each next token (and their entropy), with the output head run
over chunks of positions so that a large vocabulary's logits are never held for the whole
batch. Logprobs follow the engine's convention (robustrl/generation/engine.py):
``log_softmax(logits.float() / T)``."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor

LOGPROB_CHUNK_POSITIONS = 1024
"""Positions whose logits `token_logprobs` holds at once: 1024 x a 151,936-token vocabulary is
0.6 GB in fp32, where a batch of 512 sequences of 512 tokens would hold 160 GB."""


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    *,
    chunk: int = LOGPROB_CHUNK_POSITIONS,
) -> torch.Tensor:
    """``[B, T-1]`` logprob of each next token under ``model`` at ``temperature``
    (`logprobs_and_entropy` without the entropy)."""
    return logprobs_and_entropy(model, input_ids, attention_mask, temperature, chunk=chunk)[0]


def logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    *,
    chunk: int = LOGPROB_CHUNK_POSITIONS,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T-1]`` logprob of each next token under ``model`` at ``temperature``, and with
    `entropy` the entropy of each position's distribution (else None).

    Rows are right-padded, so the causal mask alone keeps padding out of real positions. The
    output head runs `chunk` positions at a time, each chunk's logits recomputed in the
    backward pass instead of kept (0: the whole batch at once). A model whose head this cannot
    call apart from the rest (sharded by FSDP2, or with logits post-processed in its forward)
    takes the whole batch at once.
    """
    scale = temperature if temperature > 0 else 1.0
    get_head = getattr(model, "get_output_embeddings", None)
    head, decoder = get_head() if callable(get_head) else None, getattr(model, "model", None)
    if chunk <= 0 or not _head_apart(model, head, decoder):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        picked, spread = _picked(logits[:, :-1], input_ids[:, 1:], scale, entropy)
        return picked, spread
    assert isinstance(head, torch.nn.Module) and isinstance(decoder, torch.nn.Module)
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
    ).last_hidden_state[:, :-1]
    rows, positions, width = hidden.shape
    flat, targets = hidden.reshape(rows * positions, width), input_ids[:, 1:].reshape(-1)
    pieces, spreads = [], []
    for start in range(0, rows * positions, chunk):
        h, t = flat[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            piece, spread = torch.utils.checkpoint.checkpoint(
                _chunk_logprobs, head, h, t, scale, entropy, use_reentrant=False
            )
        else:
            piece, spread = _chunk_logprobs(head, h, t, scale, entropy)
        pieces.append(piece)
        spreads.append(spread)
    spread_all = torch.cat(spreads).view(rows, positions) if entropy else None
    return torch.cat(pieces).view(rows, positions), spread_all


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    picked, spread = _picked(head(hidden), targets, scale, entropy)
    # checkpoint needs tensors: an empty one stands for "no entropy asked".
    return picked, spread if spread is not None else picked.new_empty(0)


def _picked(
    logits: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logprob of each target under `logits` at `scale`, and the entropy if asked."""
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    picked = logp.gather(-1, targets[..., None]).squeeze(-1)
    if not entropy:
        return picked, None
    return picked, -(logp.exp() * logp).sum(-1)


def _head_apart(model: torch.nn.Module, head: object, decoder: object) -> bool:
    """Whether `model`'s logits are `head(decoder(...).last_hidden_state)`, nothing more: a
    Hugging Face causal LM whose head is a plain linear layer, not sharded, and whose config
    scales or caps no logits."""
    if not isinstance(head, torch.nn.Linear) or not isinstance(decoder, torch.nn.Module):
        return False
    if isinstance(head.weight, DTensor):
        return False  # FSDP2 gathers it in the model's own forward
    config = getattr(model, "config", None)
    altered = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    return not any(getattr(config, name, None) for name in altered)
