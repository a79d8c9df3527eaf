"""The built-in task generates checkable problems, and datasets load or fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from robustrl.contracts.errors import InvalidArgument
from robustrl.generation.tasks import (
    TASKS,
    Columns,
    Message,
    TaskItem,
    UnknownTaskError,
    arithmetic_eval_split,
    generate_arithmetic,
    get_task,
    load_dataset,
    load_rows,
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
        ('{"id": "b", "prompt": "2+2="}', "no column 'answer'"),
        ('{"id": "b", "prompt": "2+2=", "answer": [4]}', "'answer' must be a string or a number"),
        ('{"id": "b", "prompt": "", "answer": "4"}', "'prompt' is empty"),
        ('{"id": "b", "prompt": [], "answer": "4"}', "got an empty list"),
        ('{"id": "b", "prompt": [{"role": "user"}], "answer": "4"}', "message 0: a chat"),
        ('{"id": "a", "prompt": "2+2=", "answer": "4"}', "duplicate id 'a'"),
    ],
)
def test_malformed_lines_name_the_file_and_the_row(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load_dataset(path)
    assert f"{path}, row 2" in str(err.value)


def test_a_parquet_file_of_chat_messages_maps_its_columns(tmp_path: Path) -> None:
    path = tmp_path / "chat.parquet"
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    again = [{"role": "user", "content": "7-1?"}]
    pq.write_table(pa.table({"question": [question, again], "solution": [5, 6]}), path)
    columns = Columns(prompt="question", answer="solution")
    first, second = load_dataset(path, columns)
    assert first == TaskItem(
        "row-1", "", "5", (Message("system", "Be brief."), Message("user", "2+3?"))
    )
    assert second == TaskItem("row-2", "", "6", (Message("user", "7-1?"),))
    with pytest.raises(ValueError, match="row 1: no column 'prompt'") as err:
        load_dataset(path)
    assert str(path) in str(err.value) and "columns: question, solution" in str(err.value)


def test_an_arrow_file_is_read_and_written_rows_come_back(tmp_path: Path) -> None:
    items = [TaskItem("q1", "", "1", (Message("user", "1?"),)), TaskItem("q2", "2?", "2")]
    jsonl = tmp_path / "rows.jsonl"
    write_dataset(items, jsonl)
    assert load_dataset(jsonl) == items
    arrow = tmp_path / "rows.arrow"
    table = pa.table({"prompt": ["a?", "b?"], "answer": ["1", "2"], "id": ["x", "y"]})
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    assert [i.id for i in load_dataset(arrow)] == ["x", "y"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "no such file"),
        ("empty.jsonl", "\n\n", "no rows"),
        ("empty.parquet", b"", "not a readable parquet file"),
        ("rows.csv", "prompt,answer\n", "a dataset is one of"),
    ],
)
def test_files_that_are_not_datasets_are_refused_naming_them(
    tmp_path: Path, name: str, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, OSError), match=message) as err:
        load_dataset(path)
    assert str(path) in str(err.value)


def test_tasks_module_does_not_import_torch() -> None:
    # The coordinator imports this module and must stay free of torch.
    code = "import sys, robustrl.generation.tasks; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=False
    )
    assert result.returncode == 0


def test_the_math_task_has_no_data_of_its_own() -> None:
    math_task = get_task("math")
    assert not math_task.generated and math_task.default_reward.endswith(":math_verified")
    with pytest.raises(ValueError, match="no data of its own"):
        math_task.generate(4, 0)
    with pytest.raises(ValueError, match="no data of its own"):
        math_task.eval_split(4)


def test_rows_for_a_spec_field_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"task.eval_dataset: cannot read .*gone.jsonl"):
        load_rows("task.eval_dataset", str(tmp_path / "gone.jsonl"), Columns())
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(InvalidArgument, match=r"^task.dataset: .*empty.parquet: not a readable"):
        load_rows("task.dataset", str(tmp_path / "empty.parquet"), Columns())
