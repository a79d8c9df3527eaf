"""GRPO: group-normalised advantages and the clipped policy-gradient step.

Async RL: a trajectory's "old" logprobs are the behaviour logprobs its rollout reported
while sampling (possibly under an older weight version), not a recomputation by the
trainer. The ratio ``exp(logp - behaviour_logp)`` therefore also corrects for staleness,
and clipping bounds how far one step moves on stale data.

Logprobs here follow the engine's convention (robustrl/generation/engine.py):
``log_softmax(logits.float() / T)`` with the sampling temperature T (T = 1 when T = 0).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from robustrl.contracts.jobspec import JobSpec
from services.trainer.logprobs import (
    LOGPROB_CHUNK_POSITIONS,
    logprobs_and_entropy,
    token_logprobs,
)


def group_advantages(rewards: Sequence[float], *, scale_by_std: bool = True) -> list[float]:
    """Advantages of one prompt group: ``(r - mean) / std`` (population std).

    A group whose rewards are all equal carries no signal and gets zero advantages.
    """
    if not rewards:
        return []
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    std = math.sqrt(sum(c * c for c in centred) / n)
    if std < 1e-8:
        return [0.0] * n
    if not scale_by_std:
        return centred
    return [c / std for c in centred]


@dataclass(frozen=True)
class Sample:
    """One trajectory ready to train on."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float

    def __post_init__(self) -> None:
        if not self.completion_ids:
            raise ValueError("a sample needs at least one completion token")
        if len(self.behaviour_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.behaviour_logprobs)} behaviour logprobs for "
                f"{len(self.completion_ids)} completion tokens"
            )


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-3
    temperature: float = 1.0
    """Must equal the rollouts' sampling temperature: logprobs are taken at it."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial policy; 0 disables it and keeps no reference model."""
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    micro_batch_size: int = 0
    """Samples per forward/backward (gradients accumulate); 0 = the whole batch at once."""
    micro_batch_tokens: int = 0
    """Padded tokens (rows x the longest row) per forward/backward; 0: no token budget."""
    loss_agg: str = "token_mean"
    """token_mean: every completion token weighs the same; seq_mean: every completion."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; 0 computes no entropy."""
    tis_cap: float = 0.0
    """0: the ratio against the behaviour logprobs, clipped. C >= 1: the ratio against the
    trainer's own (at the step's weights), and min(trainer/behaviour, C) as a token weight."""
    activation_checkpointing: bool = False
    logprob_chunk: int = LOGPROB_CHUNK_POSITIONS
    """Positions whose output-head logits are held at once (LOGPROB_CHUNK_POSITIONS); 0: the
    whole micro-batch's (what benchmarks/logprob_memory.py compares against)."""
    decay_steps: int = 0
    """Decay lr linearly to ``min_lr_ratio * lr`` over this many steps; 0 keeps it constant."""
    min_lr_ratio: float = 0.1


def lr_at(step: int, config: GRPOConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    A pure function of the step, so a trainer restored from a checkpoint resumes the
    schedule from the checkpoint's step with no scheduler state to save.
    """
    if config.decay_steps <= 0:
        return config.lr
    progress = min(step, config.decay_steps) / config.decay_steps
    return config.lr * (1.0 - (1.0 - config.min_lr_ratio) * progress)


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    grad_norm: float
    """Total gradient norm before clipping (what tells you the step was large)."""
    grad_norm_clipped: float
    """Norm of the gradient actually applied: min(grad_norm, max_grad_norm)."""
    ratio_mean: float
    clip_frac: float
    """Fraction of tokens whose ratio was clipped in the direction the advantage pushes."""
    kl: float
    num_tokens: int
    num_samples: int
    lr: float
    """Learning rate of this step (from the schedule)."""
    stepped: bool
    """False when the loss or gradient was non-finite: the optimizer did not step."""
    nonfinite: bool
    nonfinite_where: str = ""
    """Where *this* rank saw a non-finite value: "loss", "grad" or "" (none). Under data
    parallelism another rank's NaN makes `nonfinite` true here while this stays empty."""
    entropy: float = 0.0
    """Mean entropy of the policy over the completion tokens (0 unless entropy_coef > 0)."""
    tis_capped: float = 0.0
    """Fraction of tokens whose importance weight was capped at tis_cap (0 unless on)."""


def batch_tensors(
    samples: Sequence[Sample], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + completion`` rows and per-target-position tensors.

    Returns ``(input_ids, attention_mask, completion_mask, behaviour_logprobs, advantages)``;
    the last three are aligned with ``input_ids[:, 1:]`` (the tokens being predicted).
    """
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    old = torch.zeros((b, width - 1), dtype=torch.float32)
    adv = torch.zeros((b, 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[i, : p + c] = 1
        # Target position t predicts input_ids[t + 1]; completion token k sits at p + k.
        mask[i, p - 1 : p - 1 + c] = 1.0
        old[i, p - 1 : p - 1 + c] = torch.tensor(s.behaviour_logprobs)
        adv[i, 0] = s.advantage
    return input_ids, attention, mask, old, adv


def completion_logprobs(
    model: torch.nn.Module, samples: Sequence[Sample], pad_id: int, temperature: float
) -> list[list[float]]:
    """Per-token logprobs of each sample's completion under ``model`` (no gradient)."""
    input_ids, attention, mask, _, _ = batch_tensors(samples, pad_id)
    with torch.no_grad():
        logp = token_logprobs(model, input_ids, attention, temperature)
    return [logp[i][mask[i].bool()].tolist() for i in range(len(samples))]


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor
    ratio_sum: float
    clipped: float
    kl_sum: float
    entropy_sum: float = 0.0
    capped: float = 0.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
    weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    tis_cap: float = 0.0,
) -> LossParts:
    """Clipped-ratio GRPO loss, summed over masked tokens and divided by ``num_tokens``, or
    summed with each token's ``weights`` (zero off the completions) where given.

    ``advantages`` broadcasts against ``logp`` ([B, 1] per sequence or [B, T] per token).
    Dividing by the token count of the whole batch (not per sequence) keeps long and short
    completions weighted per token, and lets micro-batches add up to the full-batch loss.
    The KL term is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased);
    the entropy bonus subtracts ``entropy_coef`` times each token's ``entropy``.

    ``tis_cap`` > 0: the ratio is taken against ``logp`` itself at these weights (1 in value,
    the policy gradient in its gradient), and each token's policy term is weighted by
    ``min(exp(logp - old_logp), tis_cap)``, held constant: the engine's logprobs (``old_logp``)
    correct the trainer's only through that capped weight.
    """
    denom = float(num_tokens if num_tokens is not None else mask.sum().item())
    denom = max(denom, 1.0)
    importance, capped = None, 0.0
    base = old_logp
    if tis_cap > 0:
        base = logp.detach()
        raw = torch.exp(base - old_logp)
        importance = raw.clamp(max=tis_cap)
        capped = float(((raw > tis_cap).float() * mask).sum())
    ratio = torch.exp(logp - base)
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if importance is not None:
        per_token = per_token * importance
    # Tokens where the clipped branch won: the update there is cut off.
    was_clipped = ((ratio * advantages) > (clipped_ratio * advantages)).float()
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        kl_sum = float((kl * mask).sum().detach())
    entropy_sum = 0.0
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
        entropy_sum = float((entropy.detach() * mask).sum())
    loss = (per_token * weights).sum() if weights is not None else (per_token * mask).sum() / denom
    return LossParts(
        loss=loss,
        ratio_sum=float((ratio.detach() * mask).sum()),
        clipped=float((was_clipped * mask).sum()),
        kl_sum=kl_sum,
        entropy_sum=entropy_sum,
        capped=capped,
    )


class GRPOTrainer:
    """Policy, AdamW and (when kl_coef > 0) a frozen reference copy; one ``step`` per batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: GRPOConfig,
        pad_id: int,
        *,
        autocast: torch.dtype | None = None,
    ) -> None:
        """``model`` on its device (its parameters may be FSDP2 shards); ``autocast``: the
        forward's and backward's autocast dtype (bf16 mixed precision), None for fp32."""
        self.model = model
        self.config = config
        self.pad_id = pad_id
        self.autocast = autocast
        self.device = next(model.parameters()).device
        if config.activation_checkpointing:
            enable = getattr(model, "gradient_checkpointing_enable", None)
            if not callable(enable):
                raise ValueError(
                    "activation_checkpointing: this model has no gradient checkpointing"
                )
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken so far, read from the optimizer's own state.

        The lr schedule keys on it, so restoring the optimizer from a checkpoint also puts
        the schedule back where it was.
        """
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and "step" in state:
                    return int(state["step"])
        return 0

    def step(
        self,
        samples: Sequence[Sample],
        *,
        token_normaliser: int | None = None,
        sequence_normaliser: int | None = None,
        before_optimizer: Callable[[bool], bool] | None = None,
        passes: int | None = None,
    ) -> StepMetrics:
        """One optimizer step on ``samples``; skips the update when anything is non-finite.

        Data parallelism (services/trainer/ranks/) passes this rank's shard, the whole
        batch's completion-token count as ``token_normaliser`` (so the shards' losses and
        gradients add up to the batch's, and the token-averaged metrics are this rank's
        share of the batch's), its sample count as ``sequence_normaliser`` (the same for
        ``loss_agg`` seq_mean), and ``before_optimizer``: called after backward, before
        clipping, with whether this rank saw a non-finite loss or gradient; it sums the
        gradients over the ranks and returns whether any rank saw one. A shard may then be
        empty: the rank still joins the sum with zero gradients.

        ``passes``: FSDP2 ranks gather and reduce their shards in every forward and backward,
        so each rank runs exactly this many forward/backward passes (`passes_for`, the most any
        rank needs), the missing ones on a one-token input with a zero loss, and runs the
        backward of a non-finite loss too (the step is then skipped on every rank).
        """
        if not samples and before_optimizer is None:
            raise ValueError("cannot train on an empty batch")
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(len(s.completion_ids) for s in samples)
        denom = token_normaliser if token_normaliser is not None else num_tokens
        sequences = sequence_normaliser if sequence_normaliser is not None else len(samples)
        loss_total, ratio_sum, clipped, kl_sum, entropy_sum, capped = (0.0,) * 6
        where = ""
        chunks = micro_batches(samples, cfg.micro_batch_size, cfg.micro_batch_tokens)
        if passes is not None:
            chunks += [[]] * (passes - len(chunks))
        for chunk in chunks:
            if not chunk:
                self._idle_pass()
                continue
            input_ids, attention, mask, old, adv = (
                t.to(self.device) for t in batch_tensors(chunk, self.pad_id)
            )
            with self._precision():
                logp, entropy = logprobs_and_entropy(
                    self.model,
                    input_ids,
                    attention,
                    cfg.temperature,
                    chunk=cfg.logprob_chunk,
                    entropy=cfg.entropy_coef > 0,
                )
            ref_logp = None
            if self.ref_model is not None:
                with torch.no_grad(), self._precision():
                    ref_logp = token_logprobs(self.ref_model, input_ids, attention, cfg.temperature)
            parts = policy_loss(
                logp,
                old,
                adv,
                mask,
                clip_eps_low=cfg.clip_eps_low,
                clip_eps_high=cfg.clip_eps_high,
                ref_logp=ref_logp,
                kl_coef=cfg.kl_coef,
                num_tokens=denom,
                weights=sequence_weights(mask, sequences) if cfg.loss_agg == "seq_mean" else None,
                entropy=entropy,
                entropy_coef=cfg.entropy_coef,
                tis_cap=cfg.tis_cap,
            )
            if not torch.isfinite(parts.loss):
                where = "loss"
                if passes is None:
                    break
                # The other ranks' collectives wait for this backward: a zero loss through
                # the same graph (the step is skipped on every rank anyway).
                (torch.nan_to_num(logp, nan=0.0, posinf=0.0, neginf=0.0) * 0.0).sum().backward()
                continue
            parts.loss.backward()
            loss_total += float(parts.loss.detach())
            ratio_sum += parts.ratio_sum
            clipped += parts.clipped
            kl_sum += parts.kl_sum
            entropy_sum += parts.entropy_sum
            capped += parts.capped

        nonfinite = bool(where)
        if before_optimizer is not None:
            if not where and not _grads_finite(self.model):
                where = "grad"
            # Every rank must join the sum even after a NaN of its own (or the others would
            # wait in it forever), and a rank whose *loss* was NaN stopped before backward,
            # so no NaN would ride along in its gradient: the flag does that, and every
            # rank skips the same step.
            nonfinite = before_optimizer(bool(where))
        grad_norm = float("nan")
        if not nonfinite:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            nonfinite = not math.isfinite(grad_norm)
            if nonfinite and before_optimizer is None:
                where = "grad"
        lr = lr_at(self.steps_taken, cfg)
        if nonfinite:
            # Never step on a NaN/Inf: it would poison the weights and the optimizer moments.
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.model.eval()
        count = max(denom, 1)
        return StepMetrics(
            loss=loss_total if not nonfinite else float("nan"),
            grad_norm=grad_norm,
            grad_norm_clipped=min(grad_norm, cfg.max_grad_norm) if not nonfinite else float("nan"),
            ratio_mean=ratio_sum / count,
            clip_frac=clipped / count,
            kl=kl_sum / count,
            num_tokens=num_tokens,
            num_samples=len(samples),
            lr=lr,
            stepped=not nonfinite,
            nonfinite=nonfinite,
            nonfinite_where=where,
            entropy=entropy_sum / count,
            tis_capped=capped / count,
        )

    def passes_for(self, samples: Sequence[Sample]) -> int:
        """Forward/backward passes a step over `samples` takes."""
        cfg = self.config
        return len(micro_batches(samples, cfg.micro_batch_size, cfg.micro_batch_tokens))

    def _idle_pass(self) -> None:
        """A forward and backward that change no gradient: an FSDP2 rank with nothing (more)
        to train still joins its group's gathers and reductions."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        with self._precision():
            logits = self.model(input_ids=ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def _precision(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


def micro_batches(samples: Sequence[Sample], size: int, tokens: int) -> list[Sequence[Sample]]:
    """`samples` in order, cut into forward/backward passes: at most `size` samples each (0:
    any number) and, with a `tokens` budget, at most that many padded tokens (rows x the
    longest row) each; a sample over the budget goes alone."""
    if tokens <= 0:
        step = size or max(1, len(samples))
        return [samples[start : start + step] for start in range(0, len(samples), step)]
    out: list[Sequence[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        length = len(sample.prompt_ids) + len(sample.completion_ids)
        wider = max(longest, length)
        full = bool(size) and len(current) >= size
        if current and (full or wider * (len(current) + 1) > tokens):
            out.append(current)
            current, wider = [], length
        current.append(sample)
        longest = wider
    if current:
        out.append(current)
    return out


def sequence_weights(mask: torch.Tensor, sequences: int) -> torch.Tensor:
    """Each target position's weight in a seq_mean loss: 1 / (its completion's length x the
    batch's completions), so that each completion's token mean counts the same."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return mask / (lengths * max(sequences, 1))


def _grads_finite(model: torch.nn.Module) -> bool:
    """This rank's gradients are finite (an FSDP2 rank looks at its own shard of each)."""
    grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
    return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def grpo_config(spec: JobSpec) -> GRPOConfig:
    """A job's GRPO settings, the same on every trainer rank."""
    return GRPOConfig(
        lr=spec.trainer.lr,
        temperature=spec.rollout.temperature,
        clip_eps_low=spec.trainer.clip_eps,
        clip_eps_high=spec.trainer.clip_eps_high or spec.trainer.clip_eps,
        kl_coef=spec.trainer.kl_coef,
        max_grad_norm=spec.trainer.max_grad_norm,
        weight_decay=spec.trainer.weight_decay,
        micro_batch_tokens=spec.trainer.micro_batch_tokens,
        loss_agg=spec.trainer.loss_agg,
        entropy_coef=spec.trainer.entropy_coef,
        tis_cap=spec.trainer.tis_cap,
        activation_checkpointing=spec.trainer.activation_checkpointing,
        decay_steps=spec.trainer.planned_steps,
        min_lr_ratio=spec.trainer.min_lr_ratio,
    )
