"""Reward plug-ins load by name or path, and a misbehaving one fails loudly."""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import pytest

from robustrl.generation.rewards import (
    RewardError,
    arithmetic_exact,
    load_reward,
    math_verified,
    score,
)
from robustrl.generation.tasks import get_task


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("19", "19", 1.0),
        ("19<junk>", "19", 1.0),
        (" 19", "19", 1.0),
        ("19+3", "19", 1.0),  # only the first integer counts
        ("1", "19", 0.0),
        ("190", "19", 0.0),  # read whole, not as a prefix
        ("x19", "19", 1.0),
        ("", "19", 0.0),
        ("=", "19", 0.0),
        ("07", "7", 1.0),
        ("-3", "-3", 1.0),
    ],
)
def test_arithmetic_exact(completion: str, answer: str, expected: float) -> None:
    assert arithmetic_exact("12+7=", completion, answer) == expected


def test_load_by_module_path() -> None:
    fn = load_reward("robustrl.generation.rewards:arithmetic_exact")
    assert fn is arithmetic_exact


def test_load_by_file_path(tmp_path: Path) -> None:
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(
        "def length_bonus(prompt, completion, answer):\n    return 0.5 * len(completion)\n"
    )
    fn = load_reward(f"{plugin}:length_bonus")
    assert score(fn, "p", "abcd", "a") == 2.0


def test_two_plugin_files_with_the_same_name_stay_apart(tmp_path: Path) -> None:
    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "reward.py").write_text(f"def r(p, c, a):\n    return {value}\n")
    ra = load_reward(f"{tmp_path / 'a' / 'reward.py'}:r")
    rb = load_reward(f"{tmp_path / 'b' / 'reward.py'}:r")
    assert (ra("", "", ""), rb("", "", "")) == (1.0, 2.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("arithmetic_exact", "bad reward spec"),
        (":fn", "bad reward spec"),
        ("robustrl.generation.rewards:", "bad reward spec"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("robustrl.generation.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("/nowhere/reward.py:fn", "does not exist"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        load_reward(spec)


def test_a_plugin_that_fails_to_import_is_a_reward_error(tmp_path: Path) -> None:
    plugin = tmp_path / "broken.py"
    plugin.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="boom"):
        load_reward(f"{plugin}:r")


def test_a_non_callable_attribute(tmp_path: Path) -> None:
    plugin = tmp_path / "consts.py"
    plugin.write_text("THRESHOLD = 3\n")
    with pytest.raises(RewardError, match="not callable"):
        load_reward(f"{plugin}:THRESHOLD")


def _raises(prompt: str, completion: str, answer: str) -> float:
    raise KeyError("lookup failed")


def _returns_str(prompt: str, completion: str, answer: str) -> float:
    return "1.0"  # type: ignore[return-value]


def _returns_nan(prompt: str, completion: str, answer: str) -> float:
    return math.nan


def _returns_bool(prompt: str, completion: str, answer: str) -> float:
    return True


def _returns_none(prompt: str, completion: str, answer: str) -> float:
    return None  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_raises, "raised KeyError"),
        (_returns_str, "returned str '1.0'"),
        (_returns_nan, "non-finite"),
        (_returns_bool, "returned bool"),
        (_returns_none, "returned NoneType"),
    ],
)
def test_score_turns_misbehaviour_into_reward_error(fn: object, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        score(fn, "1+1=", "2", "2")  # type: ignore[arg-type]


def test_score_accepts_ints_and_floats() -> None:
    assert score(lambda p, c, a: 1, "", "", "") == 1.0
    assert isinstance(score(lambda p, c, a: 1, "", "", ""), float)
    assert score(lambda p, c, a: -0.25, "", "", "") == -0.25


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Half of it: \\boxed{0.5}", "1/2", 1.0),
        ("so the total is \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("The answer is 12.", "12", 1.0),
        ("\\boxed{13}", "12", 0.0),
        ("I cannot tell.", "12", 0.0),
        ("\\boxed{x^2 + 2x + 1}", "$(x+1)^2$", 1.0),
    ],
)
def test_math_verified_compares_equivalent_forms(
    completion: str, answer: str, expected: float
) -> None:
    fn = load_reward(get_task("math").default_reward)
    assert score(fn, "a problem", completion, answer) == expected


def test_math_verified_scores_off_the_main_thread() -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verified, "", "\\boxed{4}", "4").result(timeout=60) == 1.0
