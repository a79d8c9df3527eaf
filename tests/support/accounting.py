"""What every job must account for: nothing lost, nothing trained twice (the run's
trained.jsonl against the coordinator's work ledger)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import eventually_sync
from tests.support.cli import Cli, etcd_json
from tests.support.detection import LEDGER_PAGE_SIZE


def assert_nothing_lost_or_trained_twice(
    cli: Cli, job: str, run: Path, steps_run: int, groups_per_step: int = 8
) -> None:
    """Every step trained once, in order, on `groups_per_step` groups no step trained before;
    every group the job leased trained or dropped with a reason, and the ledger settled."""
    trained_ids: list[str] = []
    trained_groups: list[str] = []
    steps: list[int] = []
    for line in (run / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        steps.append(entry["step"])
        for group, detail in entry["groups"].items():
            trained_groups.append(group)
            trained_ids += detail["ids"]
    assert steps == list(range(steps_run)), "every step trained exactly once, in order"
    assert len(trained_ids) == len(set(trained_ids)), "a trajectory id was trained twice"
    assert len(trained_groups) == len(set(trained_groups)) == steps_run * groups_per_step

    def settled() -> bool:
        work = cli.json("status", job)["work"]
        return bool(work) and work["open"] == work["delivered"] == work["requeued"] == 0

    eventually_sync(settled, timeout=20)
    ledger = etcd_json(cli, f"/robustrl/work/{job}")
    leased = {f"{job}-g{i:06d}" for i in range(int(str(ledger["next_index"])))}
    discarded = cli.json("dropped", job)  # the ledger's pages and what it still lists
    assert isinstance(discarded, dict) and all(discarded.values())
    assert leased == set(trained_groups) | discarded.keys()
    assert ledger["dropped"] == len(discarded)
    # The ledger itself lists fewer than a page (LEDGER_PAGE_SIZE in DETECTION_ENV).
    assert isinstance(ledger["discarded"], dict) and isinstance(ledger["released"], dict)
    assert len(ledger["discarded"]) + len(ledger["released"]) < LEDGER_PAGE_SIZE
