"""Built-in verifiable tasks, and the dataset files a job may train and evaluate on.

A task turns a seed into prompts whose answers can be checked exactly (arithmetic), or scores
the rows of a dataset it is given (math). The coordinator uses this module to load a job's
dataset or materialise the generated one, so it must stay free of torch (the coordinator's
image carries no model stack).

Dataset files: JSON lines, parquet or arrow, one row per prompt, with a prompt column (a string
or a list of chat messages), an answer column, and optionally an id column (`Columns`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from robustrl.contracts.errors import InvalidArgument

# Seed of the held-out eval split. Training data is generated from the job's seed and never
# contains an eval prompt, so eval accuracy measures the policy, not recall of its data.
EVAL_SEED = 1_000_003


class UnknownTaskError(ValueError):
    """A task name that is not in the registry."""


@dataclass(frozen=True)
class Message:
    """One chat message of a prompt."""

    role: str
    content: str


@dataclass(frozen=True)
class TaskItem:
    """One prompt with its reference answer; ``id`` is stable across regenerations. A chat
    prompt has ``messages`` and an empty ``prompt``: the model's chat template renders it
    (robustrl/generation/prompts.py)."""

    id: str
    prompt: str
    answer: str
    messages: tuple[Message, ...] = ()


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
    generated: bool = True
    """False: the task has no data of its own (`generate` and `eval_split` raise): a job names
    its rows (``task.dataset``) and its held-out rows (``task.eval_dataset``)."""
    alphabet: str = ""
    """Every character a prompt or a correct completion can contain (sizes the tiny model's
    tokenizer); empty for a task meant for real tokenizers."""


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


def _no_data_of_its_own(task: str) -> list[TaskItem]:
    raise ValueError(f"the {task} task has no data of its own: name task.dataset and eval_dataset")


TASKS: Mapping[str, TaskSpec] = {
    "arithmetic": TaskSpec(
        name="arithmetic",
        generate=_arithmetic_generate,
        eval_split=_arithmetic_eval,
        default_reward="robustrl.generation.rewards:arithmetic_exact",
        alphabet=ARITH_ALPHABET,
    ),
    # Math problems from the job's own dataset (GSM8K, MATH, ...), scored by math-verify: the
    # completion's \boxed{} answer (or its last expression) against the reference.
    "math": TaskSpec(
        name="math",
        generate=lambda n, seed: _no_data_of_its_own("math"),
        eval_split=lambda n: _no_data_of_its_own("math"),
        default_reward="robustrl.generation.rewards:math_verified",
        generated=False,
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
            prompt: object = item.prompt
            if item.messages:
                prompt = [{"role": m.role, "content": m.content} for m in item.messages]
            row = {"id": item.id, "prompt": prompt, "answer": item.answer}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


DATASET_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
"""The files a dataset may be: JSON lines, parquet, or an arrow file (`Dataset.save_to_disk`'s
shards, or `datasets`' own cache files)."""


@dataclass(frozen=True)
class Columns:
    """Where a dataset's rows keep the prompt, the answer and (optionally) the row's id."""

    prompt: str = "prompt"
    answer: str = "answer"
    id: str = "id"


def load_dataset(path: str | Path, columns: Columns = Columns()) -> list[TaskItem]:
    """Every row of a JSONL, parquet or arrow file as a TaskItem. ValueError naming the file,
    the row (1-based: a JSONL file's line) and the column where a row is malformed, where a
    mapped column is missing, or where the file has no rows; OSError where it cannot be read.

    A prompt is a non-empty string, or a list of chat messages ({role, content}), which the
    model's chat template renders where the prompt is used. An answer is a string or a number.
    Ids come from the id column where the file has one (unique: trajectories are keyed by
    them), else from the row's number."""
    path = Path(path)
    if path.suffix not in DATASET_SUFFIXES:
        raise ValueError(f"{path}: a dataset is one of {', '.join(DATASET_SUFFIXES)} files")
    if not path.is_file():
        raise FileNotFoundError(2, "no such file", str(path))
    rows = _jsonl_rows(path) if path.suffix in (".jsonl", ".json") else _table_rows(path)
    items: list[TaskItem] = []
    seen: dict[str, int] = {}
    for number, row in rows:
        item = _item(path, number, row, columns)
        if item.id in seen:
            raise ValueError(
                f"{path}, row {number}: duplicate id {item.id!r} in column {columns.id!r} "
                f"(first in row {seen[item.id]})"
            )
        seen[item.id] = number
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no rows")
    return items


def load_rows(field: str, path: str, columns: Columns) -> list[TaskItem]:
    """`load_dataset` for the spec field `field` (`task.dataset`, `task.eval_dataset`):
    InvalidArgument naming the field, the file, the row and the column."""
    try:
        return load_dataset(path, columns)
    except OSError as exc:
        raise InvalidArgument(f"{field}: cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise InvalidArgument(f"{field}: {exc}") from exc


def _jsonl_rows(path: Path) -> Iterable[tuple[int, Mapping[str, object]]]:
    """Each non-blank line as (line number, object): read here, not by `datasets`, whose JSON
    reader names neither the line nor the file of a malformed row."""
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, row {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                kind = type(row).__name__
                raise ValueError(f"{path}, row {lineno}: expected a JSON object, got {kind}")
            yield lineno, row


def _table_rows(path: Path) -> Iterable[tuple[int, Mapping[str, object]]]:
    """A parquet or arrow file's rows, read with Hugging Face `datasets` (imported here: the
    coordinator pays for it only when a job names such a file)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.suffix == ".parquet":
            table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        else:
            table = datasets.Dataset.from_file(str(path), in_memory=True)
    except Exception as exc:  # pyarrow's and datasets' own errors: the file is not a table
        raise ValueError(f"{path}: not a readable {path.suffix[1:]} file ({exc})") from None
    assert isinstance(table, datasets.Dataset)
    for index, row in enumerate(table):
        yield index + 1, row


def _item(path: Path, number: int, row: Mapping[str, object], columns: Columns) -> TaskItem:
    where = f"{path}, row {number}"
    for column in (columns.prompt, columns.answer):
        if column not in row:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise ValueError(f"{where}: no column {column!r} (columns: {present})")
    prompt, answer = row[columns.prompt], row[columns.answer]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        kind = type(answer).__name__
        raise ValueError(
            f"{where}: column {columns.answer!r} must be a string or a number, got {kind}"
        )
    raw_id = row.get(columns.id)
    item_id = str(raw_id) if raw_id is not None and raw_id != "" else f"row-{number}"
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: column {columns.prompt!r} is empty")
        return TaskItem(id=item_id, prompt=prompt, answer=str(answer))
    if isinstance(prompt, list) and prompt:
        return TaskItem(
            id=item_id, prompt="", answer=str(answer), messages=_messages(where, columns, prompt)
        )
    kind = "an empty list" if isinstance(prompt, list) else type(prompt).__name__
    raise ValueError(
        f"{where}: column {columns.prompt!r} must be a string or a list of chat messages, "
        f"got {kind}"
    )


def _messages(where: str, columns: Columns, prompt: list[object]) -> tuple[Message, ...]:
    out = []
    for i, message in enumerate(prompt):
        ok = isinstance(message, dict) and all(
            isinstance(message.get(key), str) for key in ("role", "content")
        )
        if not ok:
            raise ValueError(
                f"{where}: column {columns.prompt!r}, message {i}: a chat message is "
                "{role: string, content: string}"
            )
        assert isinstance(message, dict)
        out.append(Message(message["role"], message["content"]))
    return tuple(out)
