"""Built-in verifiable tasks and the JSONL dataset format they travel in.

A task turns a seed into prompts whose answers can be checked exactly. The coordinator
uses this module to materialise a job's dataset and the fixed eval split, so it must stay
free of torch (the coordinator's image carries no model stack).

Dataset file format: one JSON object per line, ``{"id": str, "prompt": str, "answer": str}``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# Seed of the held-out eval split. Training data is generated from the job's seed and never
# contains an eval prompt, so eval accuracy measures the policy, not recall of its data.
EVAL_SEED = 1_000_003


class UnknownTaskError(ValueError):
    """A task name that is not in the registry."""


@dataclass(frozen=True)
class TaskItem:
    """One prompt with its reference answer; ``id`` is stable across regenerations."""

    id: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskSpec:
    """A built-in task: how to generate it and how it is scored by default."""

    name: str
    generate: Callable[[int, int], list[TaskItem]]
    """``generate(n, seed)`` -> n items, deterministic in (n, seed), none from the eval split."""
    eval_split: Callable[[int], list[TaskItem]]
    """``eval_split(n)`` -> the first n items of the fixed held-out split."""
    default_reward: str
    """Reward plug-in spec (``module:function``) that scores this task."""
    alphabet: str
    """Every character a prompt or a correct completion can contain (sizes the tokenizer)."""


# --- arithmetic -------------------------------------------------------------------------

# Difficulty of the built-in task: sums a+b with a, b in [0, 19] (400 problems, 128 held out
# for eval). Measured in benchmarks/grpo_recipe.py: a 2-layer model after a 2-second SFT
# warm-up answers ~0.1-0.2 of the held-out prompts, and GRPO lifts that by ~0.45-0.55 in 600
# steps on one CPU core. Wider operands or differences as well made the warm-up model
# mostly wrong in ways RL could not fix within minutes (it had to learn the arithmetic itself).
ARITH_MAX_OPERAND = 19
ARITH_OPS = "+"
# "-" stays in the alphabet so generate_arithmetic(ops="+-") needs no other tokenizer.
ARITH_ALPHABET = "0123456789+-="


# The held-out split is carved out of the problem space once, at this size; asking for a
# smaller eval split takes a prefix of it, so the training pool never depends on eval size.
ARITH_EVAL_POOL = 128


def arithmetic_problem(a: int, op: str, b: int) -> TaskItem:
    """The item for ``a op b``; its id names the problem, so equal problems share an id."""
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    else:
        raise ValueError(f"unsupported arithmetic operator {op!r}; expected '+' or '-'")
    prompt = f"{a}{op}{b}="
    return TaskItem(id=f"arith:{a}{op}{b}", prompt=prompt, answer=str(value))


def _arithmetic_space(max_operand: int, ops: str) -> list[tuple[int, str, int]]:
    # Differences are kept non-negative so every answer is a plain digit string.
    return [
        (a, op, b)
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if op != "-" or a >= b
    ]


def arithmetic_eval_split(
    n: int, *, max_operand: int = ARITH_MAX_OPERAND, ops: str = ARITH_OPS
) -> list[TaskItem]:
    """The first ``n`` problems of the fixed held-out split (a seeded shuffle of all problems).

    At most ARITH_EVAL_POOL problems are held out; training data never contains them.
    """
    space = _arithmetic_space(max_operand, ops)
    limit = min(ARITH_EVAL_POOL, len(space) // 2)
    if n < 0 or n > limit:
        raise ValueError(f"eval split size must be in [0, {limit}], got {n}")
    random.Random(EVAL_SEED).shuffle(space)
    return [arithmetic_problem(*p) for p in space[:n]]


def generate_arithmetic(
    n: int, seed: int, *, max_operand: int = ARITH_MAX_OPERAND, ops: str = ARITH_OPS
) -> list[TaskItem]:
    """``n`` training problems drawn (with replacement) from the problems not held out for eval.

    Sampling with replacement lets a dataset be longer than the problem space; a problem that
    repeats appears under distinct row ids (``arith:3+4#<seed>.<row>``).
    """
    if n < 0:
        raise ValueError(f"dataset size must be non-negative, got {n}")
    held_out = {
        item.prompt
        for item in arithmetic_eval_split(ARITH_EVAL_POOL, max_operand=max_operand, ops=ops)
    }
    pool = [
        p for p in _arithmetic_space(max_operand, ops) if f"{p[0]}{p[1]}{p[2]}=" not in held_out
    ]
    rng = random.Random(seed)
    items = []
    for i in range(n):
        problem = arithmetic_problem(*rng.choice(pool))
        # Rows of a dataset need distinct ids even when a problem repeats.
        items.append(
            TaskItem(id=f"{problem.id}#{seed}.{i}", prompt=problem.prompt, answer=problem.answer)
        )
    return items


def _arithmetic_generate(n: int, seed: int) -> list[TaskItem]:
    return generate_arithmetic(n, seed)


def _arithmetic_eval(n: int) -> list[TaskItem]:
    return arithmetic_eval_split(n)


TASKS: Mapping[str, TaskSpec] = {
    "arithmetic": TaskSpec(
        name="arithmetic",
        generate=_arithmetic_generate,
        eval_split=_arithmetic_eval,
        default_reward="robustrl.generation.rewards:arithmetic_exact",
        alphabet=ARITH_ALPHABET,
    ),
}


def get_task(name: str) -> TaskSpec:
    """The built-in task called ``name``; raises UnknownTaskError naming the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        known = ", ".join(sorted(TASKS))
        raise UnknownTaskError(f"unknown task {name!r}; built-in tasks: {known}") from None


# --- JSONL datasets ---------------------------------------------------------------------


def write_dataset(items: Iterable[TaskItem], path: str | Path) -> int:
    """Write items as JSONL (temp file then rename, so readers never see half a file).

    Returns the number of rows written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            row = {"id": item.id, "prompt": item.prompt, "answer": item.answer}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


def load_dataset(path: str | Path) -> list[TaskItem]:
    """Read a JSONL dataset; a malformed line raises ValueError naming the file and line.

    Blank lines are skipped. Ids must be unique: trajectories are keyed by them.
    """
    path = Path(path)
    items: list[TaskItem] = []
    seen: dict[str, int] = {}
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for field in ("id", "prompt", "answer"):
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r}")
                if not isinstance(row[field], str):
                    kind = type(row[field]).__name__
                    raise ValueError(f"{where}: field {field!r} must be a string, got {kind}")
            if not row["prompt"]:
                raise ValueError(f"{where}: field 'prompt' is empty")
            if row["id"] in seen:
                raise ValueError(
                    f"{where}: duplicate id {row['id']!r} (first on line {seen[row['id']]})"
                )
            seen[row["id"]] = lineno
            items.append(TaskItem(id=row["id"], prompt=row["prompt"], answer=row["answer"]))
    return items
