"""A standby's yielding of the CPU: process trees reniced as a whole, the setting refused
where a standby could not take its priority back, and `robustrl up --standby-nice`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from robustrl.cli import stack_commands
from robustrl.cli.context import UsageError
from robustrl.core import config, processes
from services.trainer.config import TrainerSettings
from tests.support.processes import thread_niceness

# A child with a second thread that starts a grandchild, then all wait until killed.
TREE = """
import signal, subprocess, sys, threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
print(child.pid, flush=True)
signal.pause()
"""


def test_a_process_tree_is_reniced_every_thread_and_every_descendant() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert processes.descendants(proc.pid) == [grandchild]
        assert processes.set_niceness(proc.pid, 7) >= 3  # two threads and the grandchild's
        assert thread_niceness(proc.pid) == {7}
        assert thread_niceness(grandchild) == {7}
        if processes.may_raise_priority(0):
            processes.set_niceness(proc.pid, 0)
            assert thread_niceness(proc.pid) == {0} and thread_niceness(grandchild) == {0}
        assert thread_niceness(os.getpid()) == {os.nice(0)}  # the caller was left alone
    finally:
        for pid in processes.descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def test_standby_nice_is_refused_where_the_standby_could_not_go_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(config, "may_raise_priority", lambda niceness: False)
    with pytest.raises(ValueError, match="standby_nice=10: this process may not raise"):
        TrainerSettings(standby=True, standby_nice=10)
    # Not a standby, or not nicer: nothing to go back from.
    assert TrainerSettings(standby=False, standby_nice=10).standby_nice == 10
    assert TrainerSettings(standby=True, standby_nice=0).standby_nice == 0
    with pytest.raises(ValueError, match="less than or equal to 19"):
        TrainerSettings(standby_nice=20)


def test_up_makes_standbys_nicer_by_default_only_where_they_may_go_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {"ROBUSTRL_TRAINER_STANDBY_NICE", "ROBUSTRL_ROLLOUT_STANDBY_NICE"}
    monkeypatch.setattr(stack_commands, "may_raise_priority", lambda niceness: True)
    assert stack_commands.standby_nice(None) == dict.fromkeys(names, "10")
    assert stack_commands.standby_nice(3) == dict.fromkeys(names, "3")
    monkeypatch.setattr(stack_commands, "may_raise_priority", lambda niceness: False)
    assert stack_commands.standby_nice(None) == dict.fromkeys(names, "0")
    assert stack_commands.standby_nice(0) == dict.fromkeys(names, "0")
    with pytest.raises(UsageError, match="--standby-nice 5: standbys started here could not"):
        stack_commands.standby_nice(5)
