"""benchmarks/weight_transfer.py runs end to end, at toy sizes: a benchmark that no longer runs
shows up here rather than the next time someone measures. Nothing here judges speed (the
benchmark prints its own ratios); every column must only have been measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import run_benchmark

COLUMNS = ("memcpy", "plain", "plain_verified", "ucx", "ucx_again", "ucx_cold", "grpc", "publish")


@pytest.mark.slow
def test_the_weight_benchmark_measures_every_column(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    args = ["--sizes", "1,2", "--bucket-mib", "1", "--repeat", "1", "--pullers", "2"]
    args += ["--fanout-mib", "2", "--json", str(report_path)]
    done = run_benchmark("weight_transfer.py", *args)

    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert [row["size_mib"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert all(row[column] > 0 for column in COLUMNS), row
        assert len(row["samples_s"]["ucx"]) == 1
        # Serving costs the sender some CPU: a zero would mean nothing was read.
        assert all(row["serving_cpu_per_gb"][key] > 0 for key in ("plain", "ucx")), row
    modes = [fan["mode"] for fan in report["fan_out"]]
    assert modes == [
        "all from the trainer, at once",
        "all from the trainer, 1 at a time",
        "relays, trainer serves 1 at a time",
    ]
    for fan in report["fan_out"]:
        assert 0 < fan["trainer_share"] <= 1 and fan["seconds"] > 0 and fan["first_seconds"] > 0
        assert len(fan["samples_s"]) == 2  # the first version, then --repeat warm ones
    assert "+verify/plain, on the worker ours pulls on: 1 MiB" in done.stdout
    assert "ours/plain and ours/+verify, median of the ratios within each repeat: 1 MiB" in (
        done.stdout
    )
    for row in report["rows"]:
        # Where ours' time went, from the transport's own timings of each pull.
        parts = row["ucx_parts_ms"]
        assert set(parts) == {
            "manifest_s",
            "request_s",
            "receive_s",
            "check_s",
            "first_s",
            "verify_wait_s",
        }
        assert parts["receive_s"] > 0 and parts["request_s"] > 0, parts
        # Host buckets are hashed as they land, within the receiving.
        assert 0 < parts["check_s"] < parts["receive_s"], parts
        assert 0 < parts["first_s"] < parts["receive_s"], parts
        assert 0 < row["plain_first_ms"] < 1e3 * max(row["samples_s"]["plain"]), row
        # check_s and first_s are parts of receive_s.
        whole = sum(parts.values()) - parts["check_s"] - parts["first_s"]
        assert whole <= 1e3 * max(row["samples_s"]["ucx"]), (parts, row)
    assert "where ours' time went" in done.stdout
