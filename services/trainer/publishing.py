"""How a trainer publishes its weights: the job's weight transport (UCX, or the gRPC stream),
and each version, checked finite first so that no rollout ever loads NaN/Inf. An FSDP2 group
publishes shares over UCX: rank 0 the manifest and its own buckets, each other rank its
buckets once the manifest is there (ranks/shares.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from robustrl.contracts.jobspec import JobSpec
from robustrl.core.etcd_client import until_etcd_answers
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from robustrl.generation.serving import TensorSpec, checkpoint_specs, serving_state
from robustrl.weights import WeightTransport, make_transport
from robustrl.weights.checksums import algorithm_for
from robustrl.weights.ucx.transport import UcxTransport
from services.trainer.ranks.shares import PackedShare, ShareSettings

log = get_logger(__name__)

HOLD_SHARE_TIMEOUT_S = 60.0
"""How long a rank > 0 waits for rank 0's manifest of a version it packed its share of: rank 0
writes it right after the same collective, unless etcd is away or rank 0 was fenced."""


class NonFiniteWeights(RuntimeError):
    """The weights about to be published contain NaN/Inf."""


async def open_transport(
    runtime: ServiceRuntime, spec: JobSpec, job_id: str, epoch: int
) -> WeightTransport:
    """The transport `spec.trainer.weight_transport` names, as this trainer's (`epoch`) for
    the job; waits out an etcd that does not answer."""
    assert runtime.client is not None
    client = runtime.client
    return await until_etcd_answers(
        lambda: make_transport(
            spec.trainer.weight_transport,
            client,
            runtime.keys,
            job_id,
            instance_id=runtime.instance_id,
            epoch=epoch,
            grpc_address=runtime.address,
            host=runtime.settings.resolved_advertise_host(),
            session_ttl=runtime.etcd_settings.session_ttl,
            bucket_bytes=spec.trainer.weight_bucket_mib << 20,
            checksum_algorithm=(
                None if spec.trainer.weight_checksum == "auto" else spec.trainer.weight_checksum
            ),
        ),
        "starting the weight transport",
    )


async def publish_weights(
    transport: WeightTransport,
    model: torch.nn.Module,
    step: int,
    *,
    form: dict[str, TensorSpec],
    on_nonfinite: Callable[[str], None],
    on_wait: Callable[[], None],
    unloadable: bool = False,
) -> None:
    """Publish `model`'s weights as version `step`, in their serving `form` (the checkpoint's
    names and dtypes). Non-finite values are never published: `on_nonfinite("weights")`, then
    NonFiniteWeights. `on_wait` runs while etcd does not answer. `unloadable`: without the
    last tensor (`faults.unloadable_from_step`)."""
    # No copy where the dtypes agree: the transport copies before publish returns, and the
    # model does not change while this step awaits it.
    tensors = await asyncio.to_thread(serving_state, model, form)
    if unloadable:
        tensors = tensors[:-1]

    def nonfinite() -> list[str]:
        return [name for name, t in tensors if not bool(torch.isfinite(t).all())]

    bad = await asyncio.to_thread(nonfinite)
    if bad:
        # Rollouts must never load these; the monitor reports it, recovery rolls back.
        on_nonfinite("weights")
        raise NonFiniteWeights(f"non-finite values in {', '.join(bad[:3])} at step {step}")
    # Publishing again after a failure is safe: the same epoch rewrites the same manifest.
    await until_etcd_answers(
        lambda: transport.publish(step, tensors), "publishing weights", on_wait=on_wait
    )


def share_settings(
    spec: JobSpec, transport: WeightTransport, device: torch.device
) -> ShareSettings:
    """How an FSDP2 rank packs its shares for `transport`; RuntimeError unless it is UCX
    (the gRPC stream serves whole versions from one process)."""
    if not isinstance(transport, UcxTransport):
        raise RuntimeError(
            "trainer.strategy fsdp publishes each rank's share of the weights over UCX, and "
            f"this trainer's weight transport is {transport.name} (UCX could not start here)"
        )
    algorithm = transport.publisher.checksum_algorithm or algorithm_for(device)
    return ShareSettings(
        spec.trainer.weight_bucket_mib << 20,
        algorithm,
        transport.take_buffer,
        checkpoint_specs(spec.model.path),
    )


async def publish_share(
    transport: WeightTransport,
    packed: PackedShare,
    step: int,
    *,
    on_nonfinite: Callable[[str], None],
    on_wait: Callable[[], None],
) -> None:
    """Rank 0 of an FSDP2 group: publish version `step` from the group's shares, as
    publish_weights does a whole model (any rank's non-finite piece stops it)."""
    assert isinstance(transport, UcxTransport)
    if packed.nonfinite:
        on_nonfinite("weights")
        raise NonFiniteWeights(
            f"non-finite values in {', '.join(packed.nonfinite[:3])} at step {step}"
        )
    await until_etcd_answers(
        lambda: transport.publish_share(step, packed.share),
        "publishing weights",
        on_wait=on_wait,
    )


async def hold_share(transport: WeightTransport, packed: PackedShare, version: int) -> None:
    """A rank > 0 of an FSDP2 group: serve its share of `version` once rank 0 has published
    it. A version rank 0 does not publish (non-finite, fenced, etcd away) is logged and left:
    the next one replaces it."""
    assert isinstance(transport, UcxTransport)
    if packed.nonfinite:
        return  # rank 0 refuses to publish it
    try:
        await transport.hold_share(version, packed.share, HOLD_SHARE_TIMEOUT_S)
    except Exception as exc:
        log.warning("trainer.share_not_held", version=version, error=str(exc)[:300])
