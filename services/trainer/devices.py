"""Where a trainer rank computes and in what precision, from the job's `trainer.device` and
`trainer.dtype`, and the process-group backend that goes with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import TrainerSpec


@dataclass(frozen=True)
class Compute:
    device: torch.device
    autocast: torch.dtype | None
    """The forward's and backward's autocast dtype (bf16 mixed precision); None: fp32."""

    @property
    def backend(self) -> str:
        """gloo for CPU tensors always (the ranks' own messages are CPU tensors), NCCL for
        CUDA tensors (FSDP's and the gradient sums on a GPU)."""
        return "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"


def compute_for(spec: TrainerSpec, rank: int = 0) -> Compute:
    """The device and precision of trainer rank `rank` (a CUDA rank takes its host's device
    `rank % device_count`: ranks are members on any host, and ranks sharing a host of G GPUs
    are best bound G at a time); InvalidArgument naming the field this host cannot honour."""
    cuda = torch.cuda.is_available()
    if spec.device == "cuda" and not cuda:
        raise InvalidArgument(
            "trainer.device: cuda, but this trainer's host has no CUDA device "
            "(torch.cuda.is_available() is false)"
        )
    on_cuda = spec.device == "cuda" or (spec.device == "auto" and cuda)
    dtype = spec.dtype if spec.dtype != "auto" else ("bf16" if on_cuda else "fp32")
    if dtype == "bf16" and not on_cuda:
        raise InvalidArgument(
            "trainer.dtype: bf16 is mixed precision on CUDA; this trainer computes on the CPU "
            "(device auto found no CUDA device)"
        )
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_cuda else None
    return Compute(
        device=device or torch.device("cpu"),
        autocast=torch.bfloat16 if dtype == "bf16" else None,
    )
