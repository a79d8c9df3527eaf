"""`make demo`: the local stack end to end, as a new user would drive it.

Brings the stack up, submits the example job, kills the leader coordinator with SIGKILL and
shows a standby taking over with every job intact, then shows the monitor's incident and
stops the stack. Each step is a `robustrl` command, printed before it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

console = Console(soft_wrap=True)
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/arithmetic-grpo.yaml"


def robustrl(*args: str, capture: bool = False, echo: bool = True) -> str:
    if echo:
        console.print(f"[bold cyan]$ robustrl {' '.join(args)}[/bold cyan]")
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=REPO,
        text=True,
        capture_output=capture,
        check=False,
    )
    if result.returncode != 0:
        if capture:
            console.print(result.stderr)
        raise SystemExit(f"demo: `robustrl {' '.join(args)}` failed (exit {result.returncode})")
    return result.stdout if capture else ""


def leader_pid() -> int | None:
    members = json.loads(robustrl("members", "--json", capture=True, echo=False))
    return next((int(m["pid"]) for m in members if m["leader"]), None)


def main() -> int:
    robustrl("down")  # a stack left over from an earlier run
    robustrl("up", "--trainers", "1", "--rollouts", "2")
    try:
        robustrl("submit", EXAMPLE, "trainer.steps=20", "--id", f"demo-{int(time.time())}")
        robustrl("jobs")
        old = leader_pid()
        assert old is not None, "no leader elected"
        console.print(f"[yellow]killing the leader coordinator (pid {old}) with SIGKILL[/yellow]")
        os.kill(old, signal.SIGKILL)
        started = time.monotonic()
        new = None
        while new in (None, old) and time.monotonic() - started < 15:
            time.sleep(0.2)
            new = leader_pid()
        took = time.monotonic() - started
        console.print(f"[green]new leader (pid {new}) after {took:.1f}s; jobs are intact:[/green]")
        robustrl("jobs")
        robustrl("incidents")
        robustrl("members")
    finally:
        robustrl("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
