"""The entry point vLLM loads in each of its processes (the `vllm.general_plugins` group in
pyproject.toml): it registers robustrl's backend for vLLM's weight-transfer interface under
the name `robustrl`, and ties the engine core's life to the rollout that started it. Importing
this module imports nothing heavy; the backend itself (`vllm_transfer`) is loaded only when an
engine is built with it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal

BACKEND = "robustrl"
"""The name a VLLMEngine asks for in its WeightTransferConfig."""

OWNER_ENV = "ROBUSTRL_VLLM_OWNER_PID"
"""Set by a VLLMEngine to its process id: a vLLM process whose parent that is (the engine core)
dies with it. vLLM's own workers already follow their engine core; the engine core would
outlive a rollout killed with SIGKILL, holding its memory and cores."""

ERRORS_ENV = "ROBUSTRL_VLLM_ERRORS"
"""Set by a VLLMEngine to a file: the engine core writes there the error it failed with (its
start, above all), which vLLM otherwise leaves in its log, telling its client only that it
failed."""

BUSY_LOOP_ENV = "ROBUSTRL_VLLM_BUSY_LOOP_S"
"""Set by a VLLMEngine on a host without a GPU: how long vLLM's processes spin on their
shared-memory queues after a message before they sleep until the next (vLLM: 1 s)."""

_PR_SET_PDEATHSIG = 1


def register() -> None:
    if is_engine_core():
        die_with_owner()
        report_errors()
    shorten_busy_loops()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM loads the plugins once per process, but a process that built an engine before may
    # load them again: registering twice is an error there.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "robustrl.generation.vllm_transfer", "RobustrlWeightTransfer"
        )


def is_engine_core() -> bool:
    """Whether this process is the engine core a VLLMEngine started (not one of its workers,
    nor a vLLM of another program)."""
    owner = os.environ.get(OWNER_ENV, "")
    return owner.isdigit() and os.getppid() == int(owner)


def die_with_owner() -> None:
    """SIGKILL when the parent ends (Linux's parent-death signal), and exit now if the parent
    already has."""
    owner = int(os.environ[OWNER_ENV])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return  # not Linux: the engine core is stopped by close() only
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != owner:  # the parent ended before the signal was asked for
        os._exit(1)


class _ErrorFile(logging.Handler):
    """Writes the exception of each error vLLM logs with one, last one standing."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[1] is None:
            return
        exc = record.exc_info[1]
        try:
            with open(self.path, "w") as out:
                out.write(f"{type(exc).__name__}: {exc}")
        except OSError:
            pass  # the owner then says only that the engine failed


def report_errors() -> None:
    path = os.environ.get(ERRORS_ENV, "")
    if path:
        logging.getLogger("vllm").addHandler(_ErrorFile(path))


def shorten_busy_loops() -> None:
    """vLLM's engine core and workers spin (yielding the core) for a second after each message
    on their shared-memory queues: on a CPU host where a rollout generates a batch a second,
    its worker keeps a core busy all the time, against the trainer and the other rollouts.
    With BUSY_LOOP_ENV set they spin that long instead, then wait on the queue's socket."""
    value = os.environ.get(BUSY_LOOP_ENV, "")
    if not value or OWNER_ENV not in os.environ:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    if getattr(spin, "_robustrl_busy_loop_s", None) is not None:
        return
    original = spin.__init__
    busy_loop_s = float(value)

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        kwargs["busy_loop_s"] = busy_loop_s
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    spin.__init__ = __init__  # type: ignore[method-assign]
    spin._robustrl_busy_loop_s = busy_loop_s  # type: ignore[attr-defined]
