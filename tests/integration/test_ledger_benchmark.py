"""benchmarks/ledger_writes.py runs end to end at a toy size against its real etcd and leader.
Nothing here judges speed; what it checks is what the group commit promises: a caller that
holds the lock through its write writes once per change, callers that share writes write less
often than they change the ledger, and every change was stored."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import run_benchmark


def test_the_ledger_benchmark_runs_and_shared_writes_are_fewer_than_changes(
    tmp_path: Path,
) -> None:
    rows_path = tmp_path / "rows.json"
    args = ["--callers", "1,8", "--changes", "48", "--background", "16", "--json", str(rows_path)]
    done = run_benchmark("ledger_writes.py", *args)

    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["callers"], r["mode"]): r for r in json.loads(rows_path.read_text())["rows"]}
    assert set(rows) == {(1, "own"), (1, "shared"), (8, "own"), (8, "shared")}
    assert all(r["changes"] == 48 and r["changes_per_s"] > 0 for r in rows.values())
    assert rows[1, "own"]["writes_per_change"] == rows[8, "own"]["writes_per_change"] == 1.0
    assert rows[1, "shared"]["writes_per_change"] == 1.0  # alone, nothing to share
    assert rows[8, "shared"]["writes_per_change"] < 0.5
    assert "shared/own changes/s" in done.stdout
