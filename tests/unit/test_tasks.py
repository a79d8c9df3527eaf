"""The built-in task generates checkable problems, and datasets load or fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from robustrl.generation.tasks import (
    TASKS,
    TaskItem,
    UnknownTaskError,
    arithmetic_eval_split,
    generate_arithmetic,
    get_task,
    load_dataset,
    write_dataset,
)


def _solve(prompt: str) -> int:
    assert prompt.endswith("=")
    expr = prompt[:-1]
    op = "+" if "+" in expr else "-"
    a, b = expr.split(op)
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_generation_is_deterministic_in_the_seed() -> None:
    task = get_task("arithmetic")
    assert task.generate(50, 3) == task.generate(50, 3)
    assert task.generate(50, 3) != task.generate(50, 4)
    assert task.generate(20, 3) == task.generate(50, 3)[:20]


def test_answers_are_correct_and_ids_unique() -> None:
    items = generate_arithmetic(500, 0, max_operand=25, ops="+-")
    assert {_solve(it.prompt) for it in items} and all(
        str(_solve(it.prompt)) == it.answer for it in items
    )
    assert all(int(it.answer) >= 0 for it in items)  # differences stay non-negative
    assert len({it.id for it in items}) == len(items)
    assert {it.prompt[-1] for it in items} == {"="}


def test_every_character_is_in_the_task_alphabet() -> None:
    task = get_task("arithmetic")
    chars = {
        ch for it in task.generate(300, 1) + task.eval_split(64) for ch in it.prompt + it.answer
    }
    assert chars <= set(task.alphabet)


def test_eval_split_is_fixed_and_held_out() -> None:
    task = get_task("arithmetic")
    eval_items = task.eval_split(128)
    assert eval_items == task.eval_split(128)
    assert task.eval_split(64) == eval_items[:64]
    assert len({it.prompt for it in eval_items}) == 128
    for seed in (0, 1, 2):
        train_prompts = {it.prompt for it in task.generate(4096, seed)}
        assert not train_prompts & {it.prompt for it in eval_items}
    with pytest.raises(ValueError):
        arithmetic_eval_split(10_000)


def test_unknown_task() -> None:
    with pytest.raises(UnknownTaskError, match="arithmetic") as err:
        get_task("poetry")
    assert "poetry" in str(err.value)
    assert isinstance(err.value, ValueError)
    assert "arithmetic" in TASKS


def test_dataset_round_trip(tmp_path: Path) -> None:
    items = get_task("arithmetic").generate(40, 7)
    path = tmp_path / "data" / "train.jsonl"
    assert write_dataset(items, path) == 40
    assert load_dataset(path) == items
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"id", "prompt", "answer"}


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n\n   \n')
    assert load_dataset(path) == [TaskItem("a", "1+1=", "2")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"id": "b", "prompt": "2+2="}', "missing field 'answer'"),
        ('{"id": "b", "prompt": "2+2=", "answer": 4}', "field 'answer' must be a string"),
        ('{"id": "b", "prompt": "", "answer": "4"}', "'prompt' is empty"),
        ('{"id": "a", "prompt": "2+2=", "answer": "4"}', "duplicate id 'a'"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load_dataset(path)
    assert f"{path}:2" in str(err.value)


def test_tasks_module_does_not_import_torch() -> None:
    # The coordinator imports this module and must stay free of torch.
    code = "import sys, robustrl.generation.tasks; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=False
    )
    assert result.returncode == 0
