"""A job on a checkpoint shaped like a release (Qwen2.5-0.5B's architecture cut to 2 layers:
bf16 on disk, tied embeddings, a 151,936-token vocabulary), through real service processes,
on each engine, on a parquet dataset of chat messages under columns of its own: every prompt
is rendered by the checkpoint's chat template, every version the trainer publishes is bf16,
the tied matrix once, and loads into the rollouts' engines, and the job succeeds with nothing
lost or trained twice."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from tests.support.accounting import assert_nothing_lost_or_trained_twice
from tests.support.cli import Cli
from tests.support.detection import detection_stack, incidents, submit
from tests.support.paths import REPO

pytestmark = [pytest.mark.slow]

STEPS = 3
MATH_CHAT = REPO / "examples" / "math-chat.yaml"
"""The example run here (with this file's data and sizes): a math task on chat messages."""
PUBLISHED = re.compile(r"weights\.published .*?dtypes=(\S+).*? tensor_bytes=(\d+).*? version=(\d+)")
LOADED = re.compile(r"rollout\.weights_loaded .*?version=(\d+)")


VLLM_CONTEXT = 512
"""The positions the rollouts' vLLM engines serve (of the checkpoint's 32,768): the prompts
and completions here need a few dozen, and vLLM's start on CPU took 49 s at the whole
context against 33 s at 512."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    env = {"ROBUSTRL_ROLLOUT_VLLM_MAX_MODEL_LEN": str(VLLM_CONTEXT)}
    with detection_stack(tmp_path_factory.mktemp("real"), env=env) as cli:
        yield cli


QUESTIONS = [(f"What is {a} plus {b}?", a + b) for a, b in [(3, 4), (12, 30), (7, 8), (21, 5)]]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Training and eval rows as parquet: chat messages under `question`, numbers under
    `solution`."""
    where = tmp_path_factory.mktemp("data")
    paths = []
    for name, rows in (("train", QUESTIONS), ("eval", QUESTIONS[:2])):
        chats = [[{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": q}] for q, _ in rows]  # fmt: skip
        path = where / f"{name}.parquet"
        pq.write_table(pa.table({"question": chats, "solution": [a for _, a in rows]}), path)
        paths.append(path)
    return paths[0], paths[1]


def rendered_lengths(model_dir: Path) -> list[int]:
    """The token count of each training prompt as the checkpoint's chat template renders it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = [
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}]
        for q, _ in QUESTIONS
    ]
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
    ]
    return [len(tokenizer(text)["input_ids"]) for text in texts]


def parameters(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        total = 0
        for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
            shape = st.get_slice(name).get_shape()
            count = 1
            for n in shape:
                count *= n
            total += count
    return total


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_a_bf16_tied_checkpoint_with_a_real_vocabulary_trains_on_each_engine(
    stack: Cli, like_model_dir: Path, chat_data: tuple[Path, Path], engine: str
) -> None:
    job = f"real-{engine}"
    before = {p.name: p.read_text() for p in (stack.home / "logs").glob("*.log")}
    train, held_out = chat_data
    stack.run(
        "submit",
        str(MATH_CHAT),
        "--id",
        job,
        f"model.path={like_model_dir}",
        "trainer.eval_every=1000",
        f"task.dataset={train}",
        f"task.eval_dataset={held_out}",
        "task.eval_size=2",
        "task.prompt_column=question",
        "task.answer_column=solution",
        f"rollout.engine={engine}",
        f"trainer.steps={STEPS}",
        "trainer.groups_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        # One rollout, one engine to start. Each step waits for the version before it: the
        # rollout loads every version.
        "rollout.replicas=1",
        "trainer.max_staleness=0",
    )
    watch = stack.run("watch", job, check=False, timeout=540)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert incidents(stack, job) == []

    logs = {p.name: p.read_text() for p in (stack.home / "logs").glob("*.log")}
    new = {name: text[len(before.get(name, "")) :] for name, text in logs.items()}
    published = {
        int(m[3]): (m[1], int(m[2]))
        for text in (t for n, t in new.items() if n.startswith("trainer"))
        for m in PUBLISHED.finditer(text)
    }
    # bf16 on the wire, the tied matrix once: two bytes a parameter of the checkpoint's.
    wire = 2 * parameters(like_model_dir)
    assert published, "the trainer published no version"
    assert all(v == ("bfloat16", wire) for v in published.values()), published
    loaded = {
        int(m[1])
        for text in (t for n, t in new.items() if n.startswith("rollout"))
        for m in LOADED.finditer(text)
    }
    assert set(range(1, STEPS)) <= loaded, (sorted(loaded), sorted(published))
    # The context each engine serves: vLLM's as the setting limits it, the torch engine's the
    # checkpoint's whole.
    ready = [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for text in (t for n, t in new.items() if n.startswith("rollout"))
        for line in text.splitlines()
        if "rollout.engine_ready" in line
    ]
    context = VLLM_CONTEXT if engine == "vllm" else 32_768
    assert ready and all(r["context"] == str(context) for r in ready), ready
    run = Path(stack.env["ROBUSTRL_TRAINER_RUNS_DIR"]) / job
    assert_nothing_lost_or_trained_twice(stack, job, run, STEPS, groups_per_step=2)
    # Every prompt trained on is a chat-templated one (the rows' prompt field is empty), and
    # the held-out rows were scored.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lengths = rendered_lengths(like_model_dir)
    means = [r["prompt_tokens_mean"] for r in rows if "prompt_tokens_mean" in r]
    assert len(means) == STEPS and all(min(lengths) <= m <= max(lengths) for m in means), (
        means,
        lengths,
    )
    assert any("eval_reward" in r for r in rows), rows


@pytest.mark.timeout(600)
def test_a_version_vllm_cannot_load_fails_the_job_once_naming_the_tensor(
    stack: Cli, like_model_dir: Path
) -> None:
    rollouts = {m["instance_id"]: m["pid"] for m in stack.members() if m["role"] == "rollout"}
    submit(
        stack,
        like_model_dir,
        "unloadable",
        "rollout.engine=vllm",
        "trainer.steps=20",
        "trainer.groups_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "rollout.replicas=1",
        # From step 2 on, each version lacks the checkpoint's last tensor, the final norm.
        "faults.unloadable_from_step=2",
    )
    watch = stack.run("watch", "unloadable", check=False, timeout=540)
    assert watch.returncode != 0
    status = stack.status("unloadable")
    assert status["phase"] == "FAILED", status
    message = status["message"]
    assert "cannot be loaded into the vllm engine" in message, message
    assert "missing: model.norm.weight" in message, message
    # The job's fault, not a machine's: no rollout was lost, fenced or replaced for it.
    assert incidents(stack, "unloadable") == []
    assert status["recoveries"] == []
    members = {m["instance_id"]: m for m in stack.members()}
    assert {name: members[name]["pid"] for name in rollouts} == rollouts
