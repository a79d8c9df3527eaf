"""robustrl's backend for vLLM's weight-transfer interface; it runs inside each vLLM worker.

A rollout pulls a weight version over the UCX plane as always (verified, and relayed to its
peers from its own buffer), then hands it to vLLM: `start_weight_update`, `update_weights` with
where the version is, `finish_weight_update`. Here, in the worker that owns the model's memory,
the update copies the version from the rollout's own UCX holder, straight into a staging buffer
on the model's device, verifying every bucket against the manifest as it lands (`local_copy`),
and only then loads it into the model. A copy that fails (a corrupt bucket, the rollout gone)
raises before anything is loaded, so the model keeps the weights it had.

An update may instead name a safetensors file (in shared memory) that holds the version: for a
rollout whose weights came over the gRPC stream, which has no UCX holder to copy from.

Loading goes through vLLM's layerwise reload, once the whole version is in the worker: the
model takes the weights in checkpoint form (Hugging Face names, unfused) and vLLM processes them
as at start-up, which its CPU kernels need (they repack some weights). So a copy that fails
leaves the model as it was, and `start_weight_update` / `finish_weight_update` do nothing.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

COPY_TIMEOUT_S = 600.0
"""The longest an update may take to copy its version from the rollout."""


@dataclass
class RobustrlInitInfo(WeightTransferInitInfo):
    stall_timeout: float = 30.0
    """Seconds without a bucket after which a copy from the rollout fails."""


@dataclass
class RobustrlUpdateInfo(WeightTransferUpdateInfo):
    version: int
    manifest: str = ""
    """The version's BucketManifest (JSON), when it is copied from `address`."""
    address: str = ""
    """host:port of the rollout's UCX holder, which holds the version."""
    path: str = ""
    """A safetensors file with the version, for one that has no UCX holder to copy from."""


class RobustrlWeightTransfer(WeightTransferEngine[RobustrlInitInfo, RobustrlUpdateInfo]):
    init_info_cls = RobustrlInitInfo
    update_info_cls = RobustrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stall_timeout = RobustrlInitInfo.stall_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="robustrl-verify")
        self._buffer: torch.Tensor | None = None

    def init_transfer_engine(self, init_info: RobustrlInitInfo) -> None:
        self._stall_timeout = init_info.stall_timeout

    def start_weight_update(self) -> None:
        """Nothing: the model is touched only once an update's version is here whole."""

    def finish_weight_update(self) -> None:
        """Nothing: `receive_weights` loads and processes the version in one go."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises torch.accelerator after receiving, which has no device
        # on a CPU host; a CUDA copy is synchronised here instead.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RobustrlUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if update_info.path:
            from safetensors.torch import load_file

            weights = list(load_file(update_info.path, device=str(self.device)).items())
        else:
            weights = self._copy(update_info)
        # Only now, with the whole version here and verified, does the model change. A vLLM
        # model's own loader takes Hugging Face names (fused projections included); the
        # layerwise reload processes each layer as at start-up once its weights are in.
        initialize_layerwise_reload(self.model)
        self.model.load_weights(weights=weights)  # type: ignore[operator]
        finalize_layerwise_reload(self.model, self.model_config)

    def _copy(self, info: RobustrlUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        from robustrl.weights.protocol import BucketManifest
        from robustrl.weights.ucx.buffers import allocate_buffer, unpack_views
        from robustrl.weights.ucx.local_copy import copy_from_holder

        manifest = BucketManifest.from_json(info.manifest.encode())
        if manifest.version != info.version:
            raise ValueError(f"update of v{info.version} with v{manifest.version}'s manifest")
        buffer = self._buffer
        if buffer is None or buffer.numel() != manifest.total_bytes:
            buffer = self._buffer = allocate_buffer(manifest.total_bytes, self.device)
        loop = self._running_loop()

        async def copy() -> None:
            from robustrl.weights.ucx.transport import load_ucxx

            await copy_from_holder(
                load_ucxx(),
                info.address,
                manifest,
                buffer,
                pool=self._pool,
                stall_timeout=self._stall_timeout,
            )

        asyncio.run_coroutine_threadsafe(copy(), loop).result(COPY_TIMEOUT_S)
        return list(unpack_views(manifest, buffer))

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop UCX runs on here: a thread of its own, since vLLM calls the worker
        synchronously."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="robustrl-ucx", daemon=True
            )
            self._thread.start()
            self._loop = loop
        return self._loop

    def shutdown(self) -> None:
        self._buffer = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(5)
            self._loop = None
        self._pool.shutdown(wait=False)
