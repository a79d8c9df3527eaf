"""The trainer's evaluation: greedy generations for the held-out prompts (the task's own split,
or the first `eval_size` rows of `task.eval_dataset`) under the current weights, scored by the
job's reward. Their mean is the run's `eval_reward`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.generation.engine import SamplingParams, TorchEngine
from robustrl.generation.prompts import prompt_text, render
from robustrl.generation.rewards import RewardError, RewardFn, load_reward, score
from robustrl.generation.tasks import Columns, TaskItem, UnknownTaskError, get_task, load_rows


@dataclass(frozen=True)
class Evaluation:
    items: list[TaskItem]
    reward: RewardFn
    max_new_tokens: int
    seed: int

    @classmethod
    def for_job(cls, spec: JobSpec) -> Evaluation:
        """The job's held-out split and reward; InvalidArgument naming the spec field."""
        try:
            task = get_task(spec.task.name)
        except UnknownTaskError as exc:
            raise InvalidArgument(f"task.name: {exc}") from exc
        if spec.task.eval_dataset:
            columns = Columns(spec.task.prompt_column, spec.task.answer_column)
            rows = load_rows("task.eval_dataset", spec.task.eval_dataset, columns)
            items = rows[: spec.task.eval_size]
        elif not task.generated:
            raise InvalidArgument(f"task.eval_dataset: the {task.name} task needs one")
        else:
            try:
                items = task.eval_split(spec.task.eval_size)
            except ValueError as exc:
                raise InvalidArgument(f"task.eval_size: {exc}") from exc
        try:
            reward = load_reward(spec.task.reward)
        except RewardError as exc:
            raise InvalidArgument(f"task.reward: {exc}") from exc
        return cls(items, reward, spec.rollout.max_new_tokens, spec.seed)

    async def run(self, model: Any, tokenizer: Any) -> float:
        """The mean reward over the held-out items; generation runs in a worker thread."""
        return self.score(await asyncio.to_thread(self.generate, model, tokenizer))

    def generate(
        self, model: Any, tokenizer: Any, agree: Callable[[bool], bool] | None = None
    ) -> list[str]:
        """The greedy completion of each held-out prompt. An FSDP2 group's ranks all call it
        with `agree` (TorchEngine.agree): each forward is a collective. Blocks."""
        engine = TorchEngine(model, tokenizer)
        engine.agree = agree
        prompts = [render(tokenizer, item.prompt, item.messages) for item in self.items]
        params = SamplingParams(
            n=1, temperature=0.0, max_new_tokens=self.max_new_tokens, seed=self.seed
        )
        return [completions[0].text for completions in engine.generate(prompts, params)]

    def score(self, completions: list[str]) -> float:
        """The mean reward of `completions`, one a held-out item in order."""
        total = 0.0
        for item, text in zip(self.items, completions, strict=True):
            prompt = prompt_text(item.prompt, item.messages)
            total += score(self.reward, prompt, text, item.answer)
        return total / max(1, len(self.items))
