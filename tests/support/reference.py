"""What a sampled completion's logprobs must be: one unpadded full forward, no KV cache."""

from __future__ import annotations

import torch

from robustrl.generation.engine import TorchEngine, sampling_logprobs


def full_forward_logprobs(
    engine: TorchEngine, prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> list[float]:
    """The logprob of each completion token under `engine`'s model at `temperature`, from one
    forward over prompt + completion."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    logp = sampling_logprobs(logits, temperature)
    p = len(prompt_ids)
    return [float(logp[p - 1 + k, tok]) for k, tok in enumerate(completion_ids)]
