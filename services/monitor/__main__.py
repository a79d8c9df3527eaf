"""`python -m services.monitor`: run the monitor until SIGTERM."""

from __future__ import annotations

import sys

from robustrl.core.aio import run_process
from robustrl.core.config import EtcdSettings
from services.monitor.config import MonitorSettings


async def _main() -> None:
    settings, etcd = MonitorSettings(), EtcdSettings()  # a bad one fails before imports
    from services.monitor.memory import start_on_jemalloc

    start_on_jemalloc(settings.allocator, [sys.executable, *sys.orig_argv[1:]])
    from robustrl.core.runtime import long_lived_objects

    with long_lived_objects(start=True):
        from services.monitor.server import serve
    runtime = await serve(settings, etcd)
    await runtime.serve_until_signal()


if __name__ == "__main__":
    run_process(_main())
