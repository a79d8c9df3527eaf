"""Reward plug-ins: load a user's scoring function and call it safely.

A plug-in is named ``module.path:function`` (importable) or ``path/to/file.py:function``
(loaded from the file). Its signature is::

    fn(prompt: str, completion: str, answer: str) -> float

``completion`` is the decoded completion without the end-of-sequence token; ``answer`` is
the dataset's reference answer. The return value must be a finite real number.
A plug-in that raises, or returns anything else, fails the trajectory with RewardError
rather than poisoning the batch with a made-up score.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward plug-in could not be loaded, raised, or returned something that is not a score."""


def load_reward(spec: str) -> RewardFn:
    """Resolve ``module:function`` or ``path/to/file.py:function`` to a callable."""
    target, sep, func_name = spec.rpartition(":")
    if not sep or not target or not func_name:
        raise RewardError(
            f"bad reward spec {spec!r}: expected 'module.path:function' or 'file.py:function'"
        )
    if target.endswith(".py"):
        module = _load_file(Path(target), spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardError(f"reward spec {spec!r}: cannot import module {target!r}: {e}") from e
    fn = getattr(module, func_name, None)
    if fn is None:
        raise RewardError(f"reward spec {spec!r}: module {target!r} has no attribute {func_name!r}")
    if not callable(fn):
        raise RewardError(f"reward spec {spec!r}: {func_name!r} is not callable")
    reward: RewardFn = fn
    return reward


def _load_file(path: Path, spec: str) -> object:
    if not path.is_file():
        raise RewardError(f"reward spec {spec!r}: file {str(path)!r} does not exist")
    # A per-path module name keeps two plug-in files with the same basename apart.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"robustrl_reward_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward spec {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardError(f"reward spec {spec!r}: importing {str(path)!r} failed: {e!r}") from e
    return module


def score(fn: RewardFn, prompt: str, completion: str, answer: str) -> float:
    """Call a reward plug-in; an exception or a non-finite / non-number result is RewardError."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        value = fn(prompt, completion, answer)
    except Exception as e:
        raise RewardError(f"reward {name} raised {e!r} on prompt {prompt!r}") from e
    # bool is an int subclass, but True as a score is almost always a bug in the plug-in.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"reward {name} returned {type(value).__name__} {value!r}, expected a float"
        )
    result = float(value)
    if not math.isfinite(result):
        raise RewardError(f"reward {name} returned non-finite {result!r} on prompt {prompt!r}")
    return result


# --- built-in rewards -------------------------------------------------------------------

_FIRST_INT = re.compile(r"-?\d+")


def arithmetic_exact(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the first integer in the completion equals ``answer``, else 0.0.

    The integer is read whole: "12" does not match answer "1". Text after it is ignored,
    so there is no format component; the engine stops at end-of-sequence or
    max_new_tokens, which bounds what a completion can append.
    """
    del prompt  # the answer alone decides; the prompt is in the signature for other plug-ins
    match = _FIRST_INT.search(completion)
    if match is None:
        return 0.0
    try:
        return 1.0 if int(match.group(0)) == int(answer) else 0.0
    except ValueError:
        return 0.0


def math_verified(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's answer equals ``answer`` as mathematics, else 0.0: math-verify
    extracts it (a \\boxed{} answer first, else the last expression) and compares equivalent
    forms (1/2, 0.5 and \\frac{1}{2}; 3 and 3.0). Completions it cannot parse score 0.0.

    Its time limits use SIGALRM, which only the main thread may set: elsewhere they are off.
    """
    del prompt
    from math_verify import parse, verify  # only the hosts that score the math task need it

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    latex = "$" in answer or "\\" in answer
    gold = parse(answer if latex else f"${answer}$", parsing_timeout=limit)
    found = parse(completion, parsing_timeout=limit)
    if not gold or not found:
        return 0.0
    return 1.0 if verify(gold, found, timeout_seconds=limit) else 0.0
