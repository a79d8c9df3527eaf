"""`python -m services.coordinator`: run one coordinator replica until SIGTERM."""

from __future__ import annotations

from robustrl.core.aio import run_process
from robustrl.core.config import EtcdSettings
from services.coordinator.config import CoordinatorSettings


async def _main() -> None:
    settings, etcd = CoordinatorSettings(), EtcdSettings()  # a bad one fails before imports
    from robustrl.core.runtime import long_lived_objects

    with long_lived_objects(start=True):
        from services.coordinator.server import serve
    runtime = await serve(settings, etcd)
    await runtime.serve_until_signal()


if __name__ == "__main__":
    run_process(_main())
