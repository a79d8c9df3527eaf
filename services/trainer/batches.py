"""One training step's inputs and outputs: a batch of complete groups turned into GRPO
samples, and the metrics the step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.trainer import grpo
from services.trainer.intake import Group


class InjectedError(RuntimeError):
    """A step made to fail by spec.faults.error_steps or chaos (INJECT_ERROR)."""


@dataclass
class StepInputs:
    samples: list[grpo.Sample] = field(default_factory=list)
    """The samples that carry a gradient (advantage not 0)."""
    rewards: list[float] = field(default_factory=list)
    """Every trajectory's reward."""
    staleness: list[int] = field(default_factory=list)
    """Every trajectory's steps behind: the step it trains at less its weight version."""


def step_inputs(batch: list[Group], step: int, *, scale_advantages: bool = True) -> StepInputs:
    """The batch's samples, in trajectory-id order within each group, with their advantages
    (centred rewards, divided by the group's std with `scale_advantages`)."""
    out = StepInputs()
    for group in batch:
        trajectories = sorted(group.trajectories.values(), key=lambda t: t.trajectory_id)
        group_rewards = [t.reward for t in trajectories]
        out.rewards += group_rewards
        for traj, adv in zip(
            trajectories,
            grpo.group_advantages(group_rewards, scale_by_std=scale_advantages),
            strict=True,
        ):
            out.staleness.append(step - traj.weight_version)
            if adv == 0.0:
                # No gradient; leaving it out keeps the per-token normalisation about the
                # samples that carry signal.
                continue
            out.samples.append(
                grpo.Sample(
                    prompt_ids=list(traj.prompt_ids),
                    completion_ids=list(traj.completion_ids),
                    behaviour_logprobs=list(traj.logprobs),
                    advantage=adv,
                )
            )
    return out


def step_metrics(
    batch: list[Group], inputs: StepInputs, samples: int, result: grpo.StepMetrics | None
) -> dict[str, float]:
    """What a step reports: the batch's reward, tokens (the completions'; the prompts' as a
    mean) and staleness, and the GRPO step's loss and its parts (`result`; None when no
    sample carried a gradient)."""
    trajectories = [t for g in batch for t in g.trajectories.values()]
    tokens = float(sum(len(t.completion_ids) for t in trajectories))
    staleness = inputs.staleness
    metrics = {
        "reward": sum(inputs.rewards) / len(inputs.rewards),
        "tokens": tokens,
        "prompt_tokens_mean": sum(len(t.prompt_ids) for t in trajectories) / len(trajectories),
        "samples": float(samples),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
    }
    if result is not None:  # None: every group was all-right or all-wrong, nothing to learn
        metrics |= {
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "clip_frac": result.clip_frac,
            "kl": result.kl,
            "entropy": result.entropy,
            "tis_capped_frac": result.tis_capped,
            "lr": result.lr,
            "nonfinite": float(result.nonfinite),
        }
    return metrics
