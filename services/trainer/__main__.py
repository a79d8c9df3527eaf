"""`python -m services.trainer`: run one trainer instance until SIGTERM.

Config is parsed before the model stack is imported, so a bad setting fails fast.
"""

from __future__ import annotations

from robustrl.core.aio import run_process
from robustrl.core.config import EtcdSettings
from services.trainer.config import TrainerSettings


async def _main() -> None:
    settings, etcd = TrainerSettings(), EtcdSettings()
    from robustrl.core.runtime import long_lived_objects

    with long_lived_objects(start=True):
        from services.trainer.server import serve
    runtime = await serve(settings, etcd)
    await runtime.serve_until_signal()


if __name__ == "__main__":
    run_process(_main())
