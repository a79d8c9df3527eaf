"""Where the repository and its example job are."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "arithmetic-grpo.yaml"
