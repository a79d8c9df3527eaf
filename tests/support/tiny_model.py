"""The smallest model shape the engine, GRPO and modelgen tests build (fast on one core)."""

from __future__ import annotations

from robustrl.generation.modelgen import ModelShape

TINY = ModelShape(
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=24,
)
