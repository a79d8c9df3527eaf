"""A model's serving form: the tensors its checkpoint stores, by name, with their shapes and
dtypes. It is what an engine loads and so what a trainer publishes: a bf16 checkpoint's
versions travel in bf16 whatever the trainer computes in, and a matrix the model ties to
another (a tied `lm_head.weight`) travels once, under the name the checkpoint keeps
(docs/decisions/0406-fp32-master-weights-serving-dtype-on-the-wire.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Name -> shape/dtype of every tensor in a Hugging Face safetensors checkpoint (header
    only; no tensor is read). ValueError for a folder without one or a file it cannot read."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = st.get_slice(name)
                    dtype_name = sl.get_dtype()
                    if dtype_name not in SAFETENSORS_DTYPES:
                        raise ValueError(f"{f}: tensor {name} has unsupported dtype {dtype_name}")
                    specs[name] = TensorSpec(tuple(sl.get_shape()), SAFETENSORS_DTYPES[dtype_name])
        except ValueError:
            raise
        except Exception as exc:  # safetensors' own error for a file it cannot read
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from exc
    return specs


def checkpoint_dtype(specs: dict[str, TensorSpec]) -> torch.dtype | None:
    """The one floating dtype of a checkpoint's tensors; None where it mixes several."""
    floats = {spec.dtype for spec in specs.values() if spec.dtype.is_floating_point}
    return next(iter(floats)) if len(floats) == 1 else None


def distinct_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """`named` without the names that alias a tensor already listed (tied weights share one
    storage): the first name of each stays, as safetensors keeps it."""
    seen: set[tuple[int, int]] = set()
    kept = []
    for name, tensor in named:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (int(local.untyped_storage().data_ptr()), int(local.storage_offset()))
        if local.numel() and key in seen:
            continue
        seen.add(key)
        kept.append((name, tensor))
    return kept


def check_form(
    model: torch.nn.Module, form: dict[str, TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """The model's distinct tensors, in its order, once they match `form`'s names and shapes;
    ValueError naming the tensors where they do not. Casts nothing."""
    state = distinct_tensors(model.state_dict().items())
    names = {name for name, _ in state}
    problems = []
    if missing := sorted(form.keys() - names):
        problems.append(f"the checkpoint has tensors the model lacks: {', '.join(missing[:5])}")
    if extra := sorted(names - form.keys()):
        problems.append(f"the model has tensors the checkpoint lacks: {', '.join(extra[:5])}")
    for name, tensor in state:
        spec = form.get(name)
        if spec is not None and tuple(tensor.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, the checkpoint's {spec.shape}")
    if problems:
        raise ValueError("the model does not match its checkpoint: " + "; ".join(problems))
    return state


def serving_state(
    model: torch.nn.Module, form: dict[str, TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """The model's weights in its serving form, in the model's order: each tensor of `form`,
    cast to the dtype `form` gives it (a view where it already has it). ValueError naming the
    tensors when the model and the form disagree on names or shapes (`check_form`)."""
    return [(name, t.detach().to(form[name].dtype)) for name, t in check_form(model, form)]
