"""How the CLI writes: its consoles (standard output, and standard error for errors and
warnings), and figures: ages, sizes, JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from rich.console import Console

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned with spaces, as rich's Table without a box prints them, in a fraction
    of its time: `robustrl members` lists thousands of rows."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [
        " ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (headers, *rows)
    ]
    return "\n".join(lines)


def emit_json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def age(seconds_since_epoch: float) -> str:
    delta = max(0.0, time.time() - seconds_since_epoch)
    if delta < 90:
        return f"{delta:.0f}s"
    if delta < 5400:
        return f"{delta / 60:.0f}m"
    return f"{delta / 3600:.1f}h"


def size(nbytes: float) -> str:
    """Bytes in decimal units, as transfer rates are given (GB/s)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
