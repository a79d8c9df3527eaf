"""The context a rollout's engine serves, checked before any engine starts."""

from __future__ import annotations

from pathlib import Path

from robustrl.contracts.jobspec import JobSpec
from services.rollout.config import RolloutSettings
from services.rollout.engines import engine_context
from tests.support.tiny_model import TINY


def test_a_vllm_engine_serves_the_context_its_setting_limits_it_to(tiny_model_dir: Path) -> None:
    whole = TINY.max_position_embeddings
    vllm = JobSpec.model_validate({"name": "j", "rollout": {"engine": "vllm"}})
    torch_ = JobSpec.model_validate({"name": "j", "rollout": {"engine": "torch"}})
    limited = RolloutSettings(vllm_max_model_len=whole // 2)
    assert engine_context(vllm, RolloutSettings(), tiny_model_dir) == whole
    assert engine_context(vllm, limited, tiny_model_dir) == whole // 2
    # Never more than the model has, and the torch engine is not limited by a vLLM setting.
    assert (
        engine_context(vllm, RolloutSettings(vllm_max_model_len=whole * 4), tiny_model_dir) == whole
    )
    assert engine_context(torch_, limited, tiny_model_dir) == whole
