"""`robustrl weights`: the CLI reads the transport's etcd records as JSON (it must not import
torch), so these tests feed it records the transport itself wrote."""

from __future__ import annotations

import time

import torch
from rich.console import Console

from robustrl.cli.weights import holder_summary, manifest_summary, mark_fenced, render
from robustrl.core.fences import FenceRecord
from robustrl.weights.protocol import (
    ROLE_RELAY,
    ROLE_TRAINER,
    BucketEntry,
    BucketManifest,
    HolderRecord,
    plan_layout,
)


def manifest(version: int = 4) -> BucketManifest:
    tensors = [("a", torch.zeros(1000)), ("b", torch.zeros(300, dtype=torch.int64))]
    entries, total, spans = plan_layout(tensors, 2048)
    return BucketManifest(
        job_id="j",
        version=version,
        trainer_epoch=2,
        total_bytes=total,
        bucket_bytes=2048,
        tensors=entries,
        buckets=tuple(BucketEntry(i, o, n, f"{i:032x}") for i, (o, n) in enumerate(spans)),
        published_at=time.time() - 3,
    )


def holder(instance: str, role: str, digest: str, pullers: int = 0) -> bytes:
    return HolderRecord(instance, "10.0.0.1:5000", role, 2, digest, pullers).to_json()


def test_the_summary_of_a_manifest_is_what_the_transport_wrote() -> None:
    m = manifest()
    assert len(m.buckets) == 4
    assert manifest_summary(m.to_json()) == {
        "trainer_epoch": 2,
        "total_bytes": m.total_bytes,
        "bucket_bytes": 2048,
        "buckets": 4,
        "tensors": 2,
        "dtypes": ["float32", "int64"],
        "tensor_bytes": 1000 * 4 + 300 * 8,
        "checksum_algorithm": "xxh3_128",
        "published_at": m.published_at,
        "digest": m.digest,
    }
    assert "error" in manifest_summary(b"{not json")
    assert "error" in manifest_summary(b'{"trainer_epoch": 1}')


def test_a_holder_of_other_bytes_and_unreadable_records_are_shown_as_such() -> None:
    m = manifest()
    same = holder_summary(holder("trainer-0", ROLE_TRAINER, m.digest, pullers=2), m.digest)
    assert same["same_bytes"] and same["active_pullers"] == 2 and same["role"] == "trainer"
    other = holder_summary(holder("rollout-1", ROLE_RELAY, "f" * 64), m.digest)
    assert not other["same_bytes"]
    assert "error" in holder_summary(b"[]", m.digest)

    plane = {
        "job_id": "j",
        "announcement": {"version": 4, "trainer_epoch": 2, "transport": "ucx"},
        "versions": [
            {"version": 4, "manifest": manifest_summary(m.to_json()), "holders": [same, other]},
            {"version": 3, "manifest": manifest_summary(b"garbage"), "holders": []},
        ],
        "members": None,
    }
    console = Console(width=120, record=True)
    render(plane, console)
    text = console.export_text()
    assert "version 4 announced (trainer epoch 2, over ucx)" in text
    assert "trainer-0 (trainer, 2 pulling)" in text and "rollout-1 (relay, other bytes)" in text
    assert "unreadable manifest" in text and "no monitor answered" in text


def test_members_show_the_pull_under_way_and_their_counts() -> None:
    plane = {
        "job_id": "j",
        "announcement": None,
        "versions": [],
        "members": [
            {
                "instance_id": "rollout-1",
                "role": "rollout",
                "phase": "pulling_weights",
                "counters": {
                    "weight_version": 6.0,
                    "weights_pull_version": 7.0,
                    "weights_pull_received_bytes": 3e9,
                    "weights_pull_total_bytes": 4e9,
                    "weights_pulls": 6.0,
                    "weights_checksum_failures": 1.0,
                    "weights_source_failures": 2.0,
                    "weights_bytes_served": 8e9,
                },
            },
            {
                "instance_id": "trainer-0",
                "role": "trainer",
                "state": "LOST",
                "phase": "forward_backward",
                # A trainer's transport reports pull gauges too (all 0): not shown.
                "counters": {
                    "weight_version": 5.0,
                    "weights_bytes_served": 1e6,
                    "weights_pulls": 0.0,
                    "weights_checksum_failures": 0.0,
                    "weights_source_failures": 0.0,
                },
            },
        ],
    }
    console = Console(width=120, record=True)
    render(plane, console)
    lines = console.export_text().splitlines()
    row = next(line for line in lines if "rollout-1" in line)
    assert " ".join(row.split()) == "rollout-1 pulling_weights 6 v7 75% 6 1 2 8.0 GB"
    lost = next(line for line in lines if "trainer-0" in line)
    assert " ".join(lost.split()) == "trainer-0 lost 5 - - - - 1.0 MB"


def test_a_member_fenced_from_the_job_at_its_epoch_shows_as_fenced() -> None:
    members = {
        "standby-0": {"instance_id": "standby-0", "epoch": "2", "state": "ALIVE"},
        "trainer-0": {"instance_id": "trainer-0", "epoch": "4", "state": "ALIVE"},
        "rollout-0": {"instance_id": "rollout-0", "epoch": "1", "state": "ALIVE"},
    }
    mark_fenced(
        members,
        [
            FenceRecord(instance_id="standby-0", job_id="j", epoch=2, reason="error"),
            FenceRecord(instance_id="trainer-0", job_id="j", epoch=3, reason="bound again"),
            FenceRecord(instance_id="rollout-0", job_id="other", epoch=1, reason="other job"),
        ],
        "j",
    )
    assert [m["state"] for m in members.values()] == ["FENCED", "ALIVE", "ALIVE"]
