"""GRPO math: advantages, the clipped ratio, k3 KL, and a trainer step that never eats NaN."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from robustrl.contracts.jobspec import JobSpec
from robustrl.v1 import trainer_pb2
from services.trainer.batches import step_inputs
from services.trainer.grpo import (
    GRPOConfig,
    GRPOTrainer,
    Sample,
    batch_tensors,
    completion_logprobs,
    group_advantages,
    grpo_config,
    logprobs_and_entropy,
    lr_at,
    micro_batches,
    policy_loss,
    token_logprobs,
)
from services.trainer.intake import Group

PAD = 0


# --- advantages ---------------------------------------------------------------------------


def test_group_advantages_are_normalised() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert math.sqrt(sum(a * a for a in adv) / 4) == pytest.approx(1.0)
    # mean 0.25, population std sqrt(3)/4
    assert adv[0] == pytest.approx(0.75 / (math.sqrt(3) / 4))
    assert adv[1] == adv[2] == adv[3] == pytest.approx(-0.25 / (math.sqrt(3) / 4))


def test_a_group_with_equal_rewards_has_no_signal() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.0] * 8) == [0.0] * 8
    assert group_advantages([]) == []


def test_advantages_without_std_scaling_are_centred_rewards() -> None:
    assert group_advantages([2.0, 0.0], scale_by_std=False) == [1.0, -1.0]


# --- the clipped objective ----------------------------------------------------------------


def _loss(
    ratio: float, advantage: float, eps: float = 0.2
) -> tuple[float, float, float, torch.Tensor]:
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    parts = policy_loss(
        logp,
        old,
        torch.full((1, 1), advantage),
        torch.ones(1, 1),
        clip_eps_low=eps,
        clip_eps_high=eps,
    )
    parts.loss.backward()
    assert logp.grad is not None
    return float(parts.loss.detach()), parts.ratio_sum, parts.clipped, logp.grad


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "clipped"),
    [
        (1.0, 1.0, -1.0, False),
        (1.5, 1.0, -1.2, True),  # too far up on a good token: capped at 1 + eps, no gradient
        (0.5, 1.0, -0.5, False),  # below the band on a good token: pessimistic branch, learns
        (0.5, -1.0, 0.8, True),  # too far down on a bad token: capped at 1 - eps, no gradient
        (1.5, -1.0, 1.5, False),  # above the band on a bad token: unclipped, pushed down
    ],
)
def test_ratio_clipping(
    ratio: float, advantage: float, expected_loss: float, clipped: bool
) -> None:
    loss, ratio_sum, n_clipped, grad = _loss(ratio, advantage)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert ratio_sum == pytest.approx(ratio, rel=1e-5)
    assert n_clipped == (1.0 if clipped else 0.0)
    if clipped:
        assert float(grad.abs().sum()) == 0.0
    else:
        # d/dlogp of -ratio * A = -ratio * A
        assert float(grad) == pytest.approx(-ratio * advantage, rel=1e-5)


def test_asymmetric_clip_band() -> None:
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(1.25))
    parts = policy_loss(
        logp, old, torch.ones(1, 1), torch.ones(1, 1), clip_eps_low=0.2, clip_eps_high=0.28
    )
    assert parts.clipped == 0.0  # inside [0.8, 1.28]
    assert float(parts.loss) == pytest.approx(-1.25)


def test_padding_does_not_count() -> None:
    logp = torch.tensor([[0.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    parts = policy_loss(
        logp, torch.zeros(1, 2), torch.ones(1, 1), mask, clip_eps_low=0.2, clip_eps_high=0.2
    )
    assert float(parts.loss) == pytest.approx(-1.0)
    assert parts.ratio_sum == pytest.approx(1.0)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    zero = torch.zeros(1, 1)
    same = policy_loss(
        logp, logp, zero, mask, clip_eps_low=0.2, clip_eps_high=0.2, ref_logp=logp, kl_coef=1.0
    )
    assert same.kl_sum == pytest.approx(0.0)
    ref = torch.tensor([[-1.5, -1.0]])
    moved = policy_loss(
        logp, logp, zero, mask, clip_eps_low=0.2, clip_eps_high=0.2, ref_logp=ref, kl_coef=0.5
    )
    delta = ref - logp
    expected = float((torch.exp(delta) - delta - 1).sum())
    assert moved.kl_sum == pytest.approx(expected)
    assert float(moved.loss) == pytest.approx(0.5 * expected / 2)


def test_lr_schedule() -> None:
    constant = GRPOConfig(lr=1e-3)
    assert lr_at(0, constant) == lr_at(10_000, constant) == 1e-3
    decay = GRPOConfig(lr=1e-3, decay_steps=100, min_lr_ratio=0.1)
    assert lr_at(0, decay) == pytest.approx(1e-3)
    assert lr_at(50, decay) == pytest.approx(0.55e-3)
    assert lr_at(100, decay) == lr_at(500, decay) == pytest.approx(1e-4)


# --- batching and the trainer ---------------------------------------------------------------


def test_batch_alignment() -> None:
    samples = [Sample([1, 5, 6], [7, 2], [-0.1, -0.2], 1.5), Sample([1, 5], [8], [-0.3], -1.0)]
    input_ids, attention, mask, old, adv = batch_tensors(samples, PAD)
    assert input_ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # target position t predicts input_ids[t + 1]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert old[0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert old[1, 1].item() == pytest.approx(-0.3)
    assert adv.squeeze(1).tolist() == [1.5, -1.0]


def test_sample_validates_lengths() -> None:
    with pytest.raises(ValueError):
        Sample([1], [2, 3], [-0.1], 0.0)
    with pytest.raises(ValueError):
        Sample([1], [], [], 0.0)


def _policy(tiny_model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32
    )
    return model


def _on_policy(
    model: torch.nn.Module, prompt: list[int], completion: list[int], adv: float
) -> Sample:
    lp = completion_logprobs(
        model, [Sample(prompt, completion, [0.0] * len(completion), 0.0)], PAD, 1.0
    )
    return Sample(prompt, completion, lp[0], adv)


def test_a_step_raises_the_good_completion_and_lowers_the_bad(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), pad_id=PAD)
    prompt = [1, 5, 4, 6, 16]
    good, bad = [7, 2], [9, 2]
    batch = [_on_policy(model, prompt, good, 1.0), _on_policy(model, prompt, bad, -1.0)]
    before = completion_logprobs(model, batch, PAD, 1.0)
    metrics = trainer.step(batch)
    after = completion_logprobs(model, batch, PAD, 1.0)
    assert metrics.stepped and not metrics.nonfinite
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-5)  # behaviour == current policy
    assert metrics.clip_frac == 0.0
    assert metrics.kl == 0.0
    assert metrics.num_tokens == 4 and metrics.num_samples == 2
    assert metrics.grad_norm > 0 and metrics.grad_norm_clipped <= 1.0
    assert sum(after[0]) > sum(before[0])
    assert sum(after[1]) < sum(before[1])
    assert trainer.steps_taken == 1
    assert metrics.lr == 1e-2
    assert trainer.ref_model is None


def test_stale_behaviour_logprobs_are_clipped(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3), pad_id=PAD)
    fresh = _on_policy(model, [1, 5, 4, 6, 16], [7, 2], 1.0)
    # The rollout's policy gave these tokens far less mass: ratio ~ e >> 1 + eps.
    stale = Sample(
        fresh.prompt_ids, fresh.completion_ids, [lp - 1.0 for lp in fresh.behaviour_logprobs], 1.0
    )
    metrics = trainer.step([stale])
    assert metrics.ratio_mean == pytest.approx(math.e, rel=1e-4)
    assert metrics.clip_frac == 1.0


def test_non_finite_loss_skips_the_update(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), pad_id=PAD)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    poisoned = Sample([1, 5, 4, 6, 16], [7, 2], [float("nan"), -0.1], 1.0)
    metrics = trainer.step([poisoned])
    assert metrics.nonfinite and not metrics.stepped
    assert math.isnan(metrics.loss)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert trainer.steps_taken == 0
    assert all(p.grad is None for p in model.parameters())


def test_kl_keeps_a_frozen_reference_only_when_enabled(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, kl_coef=0.1), pad_id=PAD)
    assert trainer.ref_model is not None
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())
    ref_before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    batch = [_on_policy(model, [1, 5, 4, 6, 16], [7, 2], 1.0)]
    first = trainer.step(batch)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # policy == reference before the update
    second = trainer.step(batch)
    assert second.kl > 0.0
    for k, v in trainer.ref_model.state_dict().items():
        assert torch.equal(v, ref_before[k]), k


def test_micro_batches_give_the_same_update(tiny_model_dir: Path) -> None:
    prompts = [[1, 5, 4, 6, 16], [1, 7, 4, 8, 16], [1, 9, 4, 9, 16]]
    completions = [[7, 2], [8, 9, 2], [10]]
    results = []
    for micro in (0, 1):
        model = _policy(tiny_model_dir)
        trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, micro_batch_size=micro), pad_id=PAD)
        batch = [
            _on_policy(model, p, c, a)
            for p, c, a in zip(prompts, completions, [1.0, -0.5, -0.5], strict=True)
        ]
        metrics = trainer.step(batch)
        results.append((metrics, {k: v.clone() for k, v in model.state_dict().items()}))
    (full, full_state), (micro_m, micro_state) = results
    assert micro_m.loss == pytest.approx(full.loss, rel=1e-5, abs=1e-7)
    assert micro_m.grad_norm == pytest.approx(full.grad_norm, rel=1e-4)
    for k, v in full_state.items():
        assert torch.allclose(v, micro_state[k], atol=1e-6), k


def test_the_lr_schedule_resumes_from_a_restored_optimizer(tiny_model_dir: Path) -> None:
    config = GRPOConfig(lr=1e-2, decay_steps=4, min_lr_ratio=0.5)
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, config, pad_id=PAD)
    batch = [_on_policy(model, [1, 5, 4, 6, 16], [7, 2], 1.0)]
    lrs = [trainer.step(batch).lr for _ in range(3)]
    assert lrs == pytest.approx([1e-2, 0.875e-2, 0.75e-2])
    resumed = GRPOTrainer(_policy(tiny_model_dir), config, pad_id=PAD)
    # A copy, as from a checkpoint: load_state_dict may keep the given tensors.
    resumed.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
    assert resumed.steps_taken == 3
    assert resumed.step(batch).lr == pytest.approx(trainer.step(batch).lr)


def test_an_empty_batch_is_an_error(tiny_model_dir: Path) -> None:
    trainer = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(), pad_id=PAD)
    with pytest.raises(ValueError, match="empty"):
        trainer.step([])


# --- the hooks data parallelism uses (services/trainer/ranks/) ------------------------------


def test_halves_normalised_by_the_batch_add_up_to_the_batch_step(tiny_model_dir: Path) -> None:
    """What each rank does: its shard, the batch's token count, and the summed gradients."""
    prompts = [[1, 5, 4, 6, 16], [1, 7, 4, 8, 16], [1, 9, 4, 9, 16]]
    completions = [[7, 2], [8, 9, 2], [10]]
    reference = _policy(tiny_model_dir)
    batch = [
        _on_policy(reference, p, c, a)
        for p, c, a in zip(prompts, completions, [1.0, -0.5, -0.5], strict=True)
    ]
    full = GRPOTrainer(reference, GRPOConfig(lr=1e-2), pad_id=PAD).step(batch)

    other = _policy(tiny_model_dir)
    other_trainer = GRPOTrainer(other, GRPOConfig(lr=1e-2), pad_id=PAD)
    tokens = sum(len(c) for c in completions)
    other_grads: list[torch.Tensor] = []

    def keep(nonfinite: bool) -> bool:
        other_grads.extend(p.grad.clone() for p in other.parameters() if p.grad is not None)
        return nonfinite

    # The "other rank": its half, and a hook that keeps its gradients instead of stepping.
    part = other_trainer.step(batch[2:], token_normaliser=tokens, before_optimizer=keep)

    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), pad_id=PAD)
    seen: list[bool] = []

    def add_other(nonfinite: bool) -> bool:
        seen.append(nonfinite)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for grad, g in zip(grads, other_grads, strict=True):
            grad.add_(g)
        return False

    mine = trainer.step(batch[:2], token_normaliser=tokens, before_optimizer=add_other)
    assert seen == [False]
    assert mine.loss + part.loss == pytest.approx(full.loss, rel=1e-5)
    assert mine.ratio_mean + part.ratio_mean == pytest.approx(full.ratio_mean, rel=1e-6)
    assert (mine.num_tokens, part.num_tokens) == (5, 1)
    assert mine.grad_norm == pytest.approx(full.grad_norm, rel=1e-5)
    for (name, value), expected in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.allclose(value, expected, atol=1e-6), name


def test_another_ranks_nan_skips_the_step_here_too(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), pad_id=PAD)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = [_on_policy(model, [1, 5, 4, 6, 16], [7, 2], 1.0)]
    metrics = trainer.step(batch, token_normaliser=4, before_optimizer=lambda mine: True)
    assert metrics.nonfinite and not metrics.stepped
    assert metrics.nonfinite_where == ""  # not this rank's NaN: it reports none of its own
    assert trainer.steps_taken == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_nan_here_is_flagged_to_the_hook_and_named(tiny_model_dir: Path) -> None:
    trainer = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-2), pad_id=PAD)
    poisoned = Sample([1, 5, 4, 6, 16], [7, 2], [-0.1, -0.1], float("nan"))
    flags: list[bool] = []

    def hook(mine: bool) -> bool:
        flags.append(mine)
        return mine

    metrics = trainer.step([poisoned], token_normaliser=2, before_optimizer=hook)
    assert flags == [True]
    assert metrics.nonfinite and metrics.nonfinite_where == "loss"
    single = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-2), pad_id=PAD).step([poisoned])
    assert single.nonfinite_where == "loss"


def test_an_empty_shard_still_joins_the_sum(tiny_model_dir: Path) -> None:
    trainer = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-2), pad_id=PAD)
    calls: list[bool] = []

    def hook(mine: bool) -> bool:
        calls.append(mine)
        return mine

    metrics = trainer.step([], token_normaliser=3, before_optimizer=hook)
    assert calls == [False]
    assert metrics.num_samples == 0 and metrics.num_tokens == 0 and metrics.loss == 0.0


# --- logprobs by chunks of positions --------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_logprobs_by_chunks_equal_the_whole_batchs_and_so_do_their_gradients(
    tiny_model_dir: Path, chunk: int
) -> None:
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    chunked = copy.deepcopy(whole)
    samples = [
        Sample([1, 5, 6], [7, 8, 9, 2], [-1.0] * 4, 1.0),
        Sample([1, 6], [5, 2], [-1.5] * 2, -0.5),
        Sample([1, 7, 7, 7], [6], [-0.5], 0.25),
    ]
    input_ids, attention, mask, old, adv = batch_tensors(samples, PAD)
    results = []
    for model, size in ((whole, 0), (chunked, chunk)):
        logp = token_logprobs(model, input_ids, attention, 0.7, chunk=size)
        policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2).loss.backward()
        results.append((logp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logp_whole, grads_whole), (logp_chunked, grads_chunked) = results
    assert logp_chunked.shape == logp_whole.shape == (3, 6)
    torch.testing.assert_close(logp_chunked, logp_whole, rtol=0, atol=1e-5)
    for name, grad in grads_whole.items():
        assert grad is not None and grads_chunked[name] is not None, name
        torch.testing.assert_close(grads_chunked[name], grad, rtol=1e-4, atol=1e-6)


def test_a_model_whose_head_is_not_a_plain_linear_layer_takes_the_whole_batch(
    tiny_model_dir: Path,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids, attention, *_ = batch_tensors([Sample([1, 5], [6, 2], [-1.0] * 2, 1.0)], PAD)
    expected = token_logprobs(model, input_ids, attention, 1.0, chunk=0)
    model.config.final_logit_softcapping = 30.0  # a head this could not call apart
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    got = token_logprobs(model, input_ids, attention, 1.0, chunk=1)
    assert calls == [1]  # the model's own forward, logits and all
    torch.testing.assert_close(got, expected)


# --- the loss options a job spec sets (trainer.*) --------------------------------------------


PROMPTS = [[1, 5, 4, 6, 16], [1, 7, 4, 8, 16], [1, 9, 4, 9, 16]]
COMPLETIONS = [[7, 2], [8, 9, 2, 3, 5], [10]]


def _batch(
    model: torch.nn.Module, advantages: tuple[float, ...] = (1.0, 0.5, -0.25)
) -> list[Sample]:
    rows = zip(PROMPTS, COMPLETIONS, advantages, strict=True)
    return [_on_policy(model, p, c, a) for p, c, a in rows]


def test_micro_batches_by_tokens_pack_padded_rows_under_the_budget() -> None:
    samples = [Sample([1] * 4, [2] * n, [0.0] * n, 1.0) for n in (2, 2, 6, 1, 30)]
    # Rows of 6, 6, 10, 5, 34 tokens; padded, two rows of 10 are 20 tokens.
    cuts = micro_batches(samples, 0, 20)
    assert [len(c) for c in cuts] == [2, 2, 1]  # 2 x 6; 10 and 5 padded to 2 x 10; 34 alone
    assert [s for c in cuts for s in c] == samples
    assert [len(c) for c in micro_batches(samples, 2, 1000)] == [2, 2, 1]
    assert [len(c) for c in micro_batches(samples, 0, 0)] == [5]


def test_micro_batches_by_tokens_give_the_same_update(tiny_model_dir: Path) -> None:
    results = []
    for budget in (0, 12):
        model = _policy(tiny_model_dir)
        trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, micro_batch_tokens=budget), pad_id=PAD)
        batch = _batch(model)
        assert trainer.passes_for(batch) == (1 if budget == 0 else 3)
        results.append((trainer.step(batch), {k: v.clone() for k, v in model.state_dict().items()}))
    (whole, whole_state), (cut, cut_state) = results
    assert cut.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    for k, v in whole_state.items():
        assert torch.allclose(v, cut_state[k], atol=1e-6), k


def test_sequence_mean_weighs_every_completion_the_same(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    batch = _batch(model)
    alone = [
        GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-12), pad_id=PAD).step([s]).loss
        for s in batch
    ]
    seq = GRPOTrainer(model, GRPOConfig(lr=1e-12, loss_agg="seq_mean"), pad_id=PAD).step(batch)
    token = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-12), pad_id=PAD).step(batch)
    assert seq.loss == pytest.approx(sum(alone) / len(alone), rel=1e-5)
    lengths = [len(c) for c in COMPLETIONS]
    assert token.loss == pytest.approx(
        sum(loss * n for loss, n in zip(alone, lengths, strict=True)) / sum(lengths), rel=1e-5
    )
    assert seq.loss != pytest.approx(token.loss, rel=1e-3)


def test_the_entropy_bonus_lowers_the_loss_by_its_weight_times_the_entropy(
    tiny_model_dir: Path,
) -> None:
    plain = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-12), pad_id=PAD)
    bonus = GRPOTrainer(_policy(tiny_model_dir), GRPOConfig(lr=1e-12, entropy_coef=0.1), pad_id=PAD)
    batch = _batch(_policy(tiny_model_dir))
    without, with_bonus = plain.step(batch), bonus.step(batch)
    assert without.entropy == 0.0 and with_bonus.entropy > 0.0
    # The entropy of a 33-token vocabulary's distribution is at most log(33).
    assert with_bonus.entropy <= math.log(33) + 1e-4
    assert with_bonus.loss == pytest.approx(without.loss - 0.1 * with_bonus.entropy, rel=1e-5)
    # The same entropy as computed whole, without chunks.
    ids, attention, mask, _, _ = batch_tensors(batch, PAD)
    with torch.no_grad():
        _, spread = logprobs_and_entropy(bonus.model, ids, attention, 1.0, chunk=0, entropy=True)
    assert spread is not None
    assert float((spread * mask).sum() / mask.sum()) == pytest.approx(with_bonus.entropy, rel=1e-4)


def test_truncated_importance_sampling_weights_each_token_and_caps_the_weight() -> None:
    # The trainer's prob 0.5, the engine's 0.1 and 0.4: weights 5 (capped at 2) and 1.25.
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    engine = torch.tensor([[math.log(0.1), math.log(0.4)]])
    parts = policy_loss(
        logp,
        engine,
        torch.ones(1, 1),
        torch.ones(1, 2),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        tis_cap=2.0,
    )
    parts.loss.backward()
    assert float(parts.loss.detach()) == pytest.approx(-(2.0 + 1.25) / 2)
    assert parts.capped == 1.0 and parts.clipped == 0.0 and parts.ratio_sum == pytest.approx(2.0)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -0.625])  # -weight x A / tokens
    # Off, the ratio against the engine's logprobs is clipped instead.
    off = policy_loss(
        logp.detach(),
        engine,
        torch.ones(1, 1),
        torch.ones(1, 2),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )
    assert off.clipped == 2.0 and float(off.loss) == pytest.approx(-1.2)


def test_activation_checkpointing_gives_the_same_update(tiny_model_dir: Path) -> None:
    states = []
    for on in (False, True):
        model = _policy(tiny_model_dir)
        trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, activation_checkpointing=on), pad_id=PAD)
        assert model.is_gradient_checkpointing == on
        trainer.step(_batch(model))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for k, v in states[0].items():
        assert torch.allclose(v, states[1][k], atol=1e-6), k


def test_every_loss_setting_of_the_spec_reaches_the_trainer(tiny_model_dir: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "trainer": {
                "clip_eps": 0.1,
                "clip_eps_high": 0.28,
                "max_grad_norm": 0.5,
                "weight_decay": 0.01,
                "loss_agg": "seq_mean",
                "entropy_coef": 0.001,
                "tis_cap": 2.0,
                "micro_batch_tokens": 4096,
                "activation_checkpointing": True,
            },
        }
    )
    config = grpo_config(spec)
    assert (config.clip_eps_low, config.clip_eps_high, config.max_grad_norm) == (0.1, 0.28, 0.5)
    assert (config.weight_decay, config.loss_agg, config.entropy_coef) == (0.01, "seq_mean", 0.001)
    assert (config.tis_cap, config.micro_batch_tokens, config.activation_checkpointing) == (
        2.0,
        4096,
        True,
    )
    assert grpo_config(JobSpec.model_validate({"name": "x"})).clip_eps_high == 0.2
    trainer = GRPOTrainer(_policy(tiny_model_dir), config, pad_id=PAD)
    assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.01}
    with pytest.raises(ValueError, match="tis_cap"):
        JobSpec.model_validate({"name": "x", "trainer": {"tis_cap": 0.5}})


def test_a_step_clips_the_gradient_to_max_grad_norm(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, max_grad_norm=1e-3), pad_id=PAD)
    metrics = trainer.step(_batch(model, (4.0, -2.0, -2.0)))
    assert metrics.grad_norm > 1e-3 and metrics.grad_norm_clipped == pytest.approx(1e-3)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_advantages_scaled_by_the_groups_std_or_only_centred() -> None:
    group = Group("g", 2)
    for i, reward in enumerate((1.0, 0.0)):
        group.trajectories[f"g/{i}"] = trainer_pb2.Trajectory(
            trajectory_id=f"g/{i}",
            prompt_ids=[1, 2],
            completion_ids=[3],
            logprobs=[-1.0],
            reward=reward,
        )
    scaled = step_inputs([group], 0)
    centred = step_inputs([group], 0, scale_advantages=False)
    assert [s.advantage for s in scaled.samples] == [1.0, -1.0]
    assert [s.advantage for s in centred.samples] == [0.5, -0.5]
