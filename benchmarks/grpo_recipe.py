"""GRPO recipe check: does RL on the built-in task measurably improve the generated policy?

Single process, no gRPC: generate the model (init + SFT warm-up), then alternate
sample-with-the-engine / GRPO-step-with-the-trainer, pushing weights from trainer to
engine through ``Engine.load_weights`` as the services do. ``--lag k`` makes the engine
sample with the weights of k steps ago (async RL with staleness k; 0 = synchronous).
Greedy accuracy on the fixed held-out eval split is printed every few steps, then the
curve and the wall time of each phase.

    python benchmarks/grpo_recipe.py                 # the recipe the demo uses
    python benchmarks/grpo_recipe.py --steps 100 --eval-every 20 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from robustrl.generation.engine import Engine, SamplingParams, TorchEngine
from robustrl.generation.modelgen import ModelShape, SFTConfig, init_model, sft_warmup
from robustrl.generation.rewards import RewardFn, load_reward, score
from robustrl.generation.tasks import TaskItem, get_task
from services.trainer.grpo import GRPOConfig, GRPOTrainer, Sample, group_advantages


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    task: str = "arithmetic"
    hidden_size: int = ModelShape.hidden_size
    intermediate_size: int = ModelShape.intermediate_size
    num_layers: int = ModelShape.num_layers
    num_heads: int = ModelShape.num_heads
    num_kv_heads: int = ModelShape.num_kv_heads
    sft_steps: int = SFTConfig.steps
    sft_lr: float = SFTConfig.lr
    lr: float = 1e-3
    lr_decay: bool = True
    """Decay lr linearly to 10% over the RL steps."""
    prompts_per_step: int = 64
    group_size: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    steps: int = 600
    eval_every: int = 50
    eval_size: int = 128
    train_size: int = 4096
    kl_coef: float = 0.0
    lag: int = 0


def evaluate(engine: Engine, items: list[TaskItem], reward: RewardFn, max_new_tokens: int) -> float:
    """Mean reward of greedy completions over ``items``."""
    groups = engine.generate(
        [it.prompt for it in items],
        SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
    )
    total = sum(
        score(reward, it.prompt, g[0].text, it.answer) for it, g in zip(items, groups, strict=True)
    )
    return total / len(items)


def rollout_batch(
    engine: Engine, items: list[TaskItem], reward: RewardFn, params: SamplingParams
) -> tuple[list[Sample], list[float]]:
    """Sample a group per prompt, score it, and keep the samples that carry signal."""
    samples: list[Sample] = []
    rewards_seen: list[float] = []
    groups = engine.generate([it.prompt for it in items], params)
    for item, group in zip(items, groups, strict=True):
        rewards = [score(reward, item.prompt, c.text, item.answer) for c in group]
        rewards_seen.extend(rewards)
        for c, adv in zip(group, group_advantages(rewards), strict=True):
            # A zero advantage adds no gradient; leaving such samples out keeps the
            # per-token normalisation about the groups that carry signal.
            if adv != 0.0:
                samples.append(Sample(c.prompt_ids, c.token_ids, c.logprobs, adv))
    return samples, rewards_seen


def run(recipe: Recipe, model_dir: Path) -> list[tuple[int, float]]:
    task = get_task(recipe.task)
    t0 = time.monotonic()
    shape = ModelShape(
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_layers=recipe.num_layers,
        num_heads=recipe.num_heads,
        num_kv_heads=recipe.num_kv_heads,
    )
    init_model(model_dir, recipe.seed, task=recipe.task, shape=shape)
    gen_s = time.monotonic() - t0
    sft = sft_warmup(
        model_dir,
        SFTConfig(steps=recipe.sft_steps, lr=recipe.sft_lr, seed=recipe.seed),
        task=recipe.task,
        log_every=0,
    )
    print(f"model init {gen_s:.1f}s, sft warm-up {sft.seconds:.1f}s (loss {sft.final_loss:.3f})")

    engine = TorchEngine.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        policy,
        GRPOConfig(
            lr=recipe.lr,
            temperature=recipe.temperature,
            kl_coef=recipe.kl_coef,
            decay_steps=recipe.steps if recipe.lr_decay else 0,
        ),
        pad_id=engine.pad_id,
    )
    reward = load_reward(task.default_reward)
    eval_items = task.eval_split(recipe.eval_size)
    train_items = task.generate(recipe.train_size, recipe.seed)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    # Weights published but not yet seen by the engine: the staleness simulation.
    in_flight: collections.deque[dict[str, torch.Tensor]] = collections.deque()

    curve: list[tuple[int, float]] = []
    window: list[float] = []
    sample_s = train_s = eval_s = 0.0
    rl_started = time.monotonic()
    for step in range(recipe.steps + 1):
        if step % recipe.eval_every == 0 or step == recipe.steps:
            t = time.monotonic()
            acc = evaluate(engine, eval_items, reward, recipe.max_new_tokens)
            eval_s += time.monotonic() - t
            curve.append((step, acc))
            train = sum(window) / len(window) if window else float("nan")
            window.clear()
            print(
                f"step {step:4d}  eval {acc:.3f}  train reward {train:.3f}  "
                f"weights v{engine.weight_version}  t {time.monotonic() - rl_started:6.1f}s",
                flush=True,
            )
        if step == recipe.steps:
            break
        t = time.monotonic()
        params = SamplingParams(
            n=recipe.group_size,
            temperature=recipe.temperature,
            max_new_tokens=recipe.max_new_tokens,
            seed=recipe.seed * 1_000_003 + step,
        )
        samples, rewards = rollout_batch(
            engine, rng.sample(train_items, recipe.prompts_per_step), reward, params
        )
        window.extend(rewards)
        t1 = time.monotonic()
        sample_s += t1 - t
        if samples:
            metrics = trainer.step(samples)
            if metrics.nonfinite:
                print(f"step {step}: non-finite loss or gradient, update skipped", flush=True)
        in_flight.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        if len(in_flight) > recipe.lag:
            engine.load_weights(in_flight.popleft().items(), version=step + 1 - recipe.lag)
        train_s += time.monotonic() - t1
    rl_s = time.monotonic() - rl_started
    print(
        f"rl: {recipe.steps} steps in {rl_s:.1f}s "
        f"(sampling {sample_s:.1f}s, training + weight push {train_s:.1f}s, eval {eval_s:.1f}s)"
    )
    print("curve: " + " ".join(f"{s}:{a:.3f}" for s, a in curve))
    print(
        f"first eval {curve[0][1]:.3f}, last eval {curve[-1][1]:.3f}, "
        f"gain {curve[-1][1] - curve[0][1]:+.3f}; total wall {time.monotonic() - t0:.1f}s"
    )
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Recipe()
    for f in fields(Recipe):
        value = getattr(defaults, f.name)
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model-dir", default="", help="keep the model here (default: temp dir)")
    args = vars(parser.parse_args(argv))
    torch.set_num_threads(args.pop("threads"))
    model_dir = args.pop("model_dir")
    recipe = Recipe(**args)
    print(recipe, flush=True)
    if model_dir:
        run(recipe, Path(model_dir))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run(recipe, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
