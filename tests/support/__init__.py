"""What the tests share, one module per concern; no test module imports another.

waiting      eventually(...) instead of fixed sleeps
processes    /proc state of a process, SIGSTOP for a block
forked       processes forked from a warm template, driven over pipes
etcd         a real etcd process on free ports
loops        an event loop closed in bounded time
cluster      coordinators, members and small etcds in the test's process
role_control a data-plane role's control with a counting worker
cli          the `robustrl` command against a local stack of the test's own
detection    that stack with fast detection settings; what its monitor reported
benchmarks   a benchmark script run to its end
tiny_model   the tiny model's settings; ucx_peer: a weight-plane peer process
"""

from tests.support.benchmarks import run_benchmark
from tests.support.processes import process_state, stop_process, stopped
from tests.support.waiting import eventually, eventually_sync

__all__ = [
    "eventually",
    "eventually_sync",
    "process_state",
    "run_benchmark",
    "stop_process",
    "stopped",
]
