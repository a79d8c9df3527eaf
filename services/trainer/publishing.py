"""How a trainer publishes its weights: the job's weight transport (UCX, or the gRPC stream),
and each version, checked finite first so that no rollout ever loads NaN/Inf."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from robustrl.contracts.jobspec import JobSpec
from robustrl.core.etcd_client import until_etcd_answers
from robustrl.core.runtime import ServiceRuntime
from robustrl.weights import WeightTransport, make_transport


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
    on_nonfinite: Callable[[str], None],
    on_wait: Callable[[], None],
) -> None:
    """Publish `model`'s weights as version `step`. Non-finite values are never published:
    `on_nonfinite("weights")`, then NonFiniteWeights. `on_wait` runs while etcd does not
    answer."""
    # No copy here: the transport copies before publish returns, and the model does not
    # change while this step awaits it.
    tensors = [(name, t.detach()) for name, t in model.state_dict().items()]

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
