"""One warm template for every local stack this test process starts (`up --template-socket`):
a stack of its own would import torch, transformers and the servers once more, 5-15 s of a
core each time. Started at the first `up` that asks for it; it exits with this process."""

from __future__ import annotations

from robustrl.cli.stack import StackState
from robustrl.core.template import PRELOAD
from tests.support.forked import Template

_serving: list[Template] = []


def socket() -> str:
    """The shared template's socket, once it serves."""
    if not _serving:
        template = Template(*PRELOAD)
        template.wait_ready()
        _serving.append(template)
    return str(_serving[0].socket)


def template_pid(state: StackState) -> int:
    """The pid of the template the stack forks its members from: its own, or the shared one."""
    if state.template_shared:
        [template] = _serving
        assert str(template.socket) == state.template_socket, state.template_socket
        return template.proc.pid
    return next(p.pid for p in state.procs if p.role == "template")
