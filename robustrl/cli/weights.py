"""`robustrl weights JOB`: where a job's weight versions are, and how each member's pulls go.

From etcd: the announcement (the newest version, its trainer epoch and transport) and every
version still kept, with its manifest's summary (size, buckets, checksum, epoch, age) and its
holders (the trainer and the relays, with their active pullers; a holder whose digest differs
from the manifest's holds other bytes and is marked so). From the monitor: each member of the
job's phase and weight gauges (`weights_*`, sent in its heartbeats): the version it runs, the
pull under way (bytes received of the total), and its counts of pulls, failed checksums, lost
sources and bytes served to others. A member the monitor lost shows `lost` for its phase, and
a fenced one (replaced, still running until it learns so) `fenced`, each with the figures of
its last beat.

The records are read as JSON here, not through the transport: the CLI stays free of torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table

from robustrl.cli.client import DEFAULT_DEADLINE, StackClient
from robustrl.cli.formatting import age, emit_json, size
from robustrl.contracts.keys import WeightKeys
from robustrl.contracts.roles import ROLE_FROM_PROTO
from robustrl.core.channels import open_channel
from robustrl.core.fences import FenceRecord
from robustrl.v1 import coordinator_pb2, monitor_pb2, monitor_pb2_grpc


def manifest_summary(raw: bytes) -> dict[str, Any]:
    """What a manifest says about its version, or {"error": ...} if it cannot be read."""
    try:
        body = json.loads(raw)
        return {
            "trainer_epoch": int(body["trainer_epoch"]),
            "total_bytes": int(body["total_bytes"]),
            "bucket_bytes": int(body["bucket_bytes"]),
            "buckets": len(body["checksums"]),
            "tensors": len(body["tensors"]),
            # [name, dtype, shape, offset, nbytes] each (weights/protocol.py)
            "dtypes": sorted({str(t[1]) for t in body["tensors"]}),
            "tensor_bytes": sum(int(t[4]) for t in body["tensors"]),
            "checksum_algorithm": str(body.get("checksum_algorithm", "")),
            "published_at": float(body.get("published_at", 0.0)),
            "digest": str(body.get("digest", "")),
        }
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"unreadable manifest: {exc!r}"[:200]}


def holder_summary(raw: bytes, digest: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
        return {
            "instance_id": str(body["instance_id"]),
            "role": str(body["role"]),
            "address": str(body["address"]),
            "trainer_epoch": int(body["trainer_epoch"]),
            "active_pullers": int(body.get("active_pullers", 0)),
            "max_pullers": int(body.get("max_pullers", 0)),
            "same_bytes": bool(digest) and body.get("digest") == digest,
        }
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"unreadable holder record: {exc!r}"[:200]}


async def versions(client: StackClient, job_id: str) -> list[dict[str, Any]]:
    """Every version of the job in etcd, newest first, with its manifest and holders."""
    wkeys = WeightKeys(client.keys)
    manifests: dict[int, bytes] = {}
    holders: dict[int, list[bytes]] = {}
    for kv in await client.etcd.get_prefix(wkeys.versions(job_id)):
        parsed = wkeys.parse(job_id, kv.key)
        if parsed is None:
            continue
        version, rest = parsed
        if rest == "manifest":
            manifests[version] = kv.value
        elif rest.startswith("holders/"):
            holders.setdefault(version, []).append(kv.value)
    out = []
    for version in sorted(manifests.keys() | holders.keys(), reverse=True):
        manifest = manifest_summary(manifests[version]) if version in manifests else None
        digest = str((manifest or {}).get("digest", ""))
        out.append(
            {
                "version": version,
                "manifest": manifest,
                "holders": sorted(
                    (holder_summary(raw, digest) for raw in holders.get(version, [])),
                    key=lambda h: (h.get("role") != "trainer", h.get("instance_id", "")),
                ),
            }
        )
    return out


async def member_gauges(client: StackClient, job_id: str) -> list[dict[str, Any]] | None:
    """The job's members as the monitor last heard them (phase, weight gauges), or None when
    no monitor answers. A member that beats to another monitor replica is found there."""
    found: dict[str, dict[str, Any]] = {}
    answered = False
    for monitor in await client.members("monitor"):
        try:
            async with open_channel(monitor.address) as channel:
                reply = await monitor_pb2_grpc.MonitorStub(channel).GetHealth(
                    monitor_pb2.GetHealthRequest(job_id=job_id), timeout=DEFAULT_DEADLINE
                )
        except grpc.aio.AioRpcError:
            continue
        answered = True
        for health in reply.members:
            row = MessageToDict(
                health, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            row["role"] = ROLE_FROM_PROTO[health.role]
            seen = found.get(health.instance_id)
            if seen is None or row["last_seen"] > seen["last_seen"]:
                found[health.instance_id] = row
    if not answered:
        return None
    fences = [
        FenceRecord.model_validate_json(kv.value)
        for kv in await client.etcd.get_prefix(client.keys.fences())
    ]
    mark_fenced(found, fences, job_id)
    return sorted(found.values(), key=lambda r: (r["role"], r["instance_id"]))


def mark_fenced(members: dict[str, dict[str, Any]], fences: list[FenceRecord], job_id: str) -> None:
    """State FENCED for each member fenced from job_id at its epoch or a later one. A fenced
    member (replaced; a trainer stopped on an error, say) may still run and beat with the job's
    id until it learns of its fence, but it is no longer part of the job; a member bound again
    at a higher epoch is a new incarnation."""
    for fence in fences:
        row = members.get(fence.instance_id)
        if row is not None and fence.job_id == job_id and int(row["epoch"]) <= fence.epoch:
            row["state"] = "FENCED"


async def weight_plane(client: StackClient, job_id: str) -> dict[str, Any]:
    raw = await client.etcd.get(WeightKeys(client.keys).announcement(job_id))
    return {
        "job_id": job_id,
        "announcement": json.loads(raw.value) if raw is not None else None,
        "versions": await versions(client, job_id),
        "members": await member_gauges(client, job_id),
    }


def _holder_cell(holder: dict[str, Any]) -> str:
    if "error" in holder:
        return holder["error"]
    cell = f"{holder['instance_id']} ({holder['role']}"
    if holder["active_pullers"]:
        cell += f", {holder['active_pullers']} pulling"
    if not holder["same_bytes"]:
        cell += ", other bytes"
    return cell + ")"


def _pull_cell(counters: dict[str, float]) -> str:
    total = counters.get("weights_pull_total_bytes", 0.0)
    if not total:
        return "-"
    received = counters.get("weights_pull_received_bytes", 0.0)
    return f"v{counters.get('weights_pull_version', 0.0):.0f} {100 * received / total:.0f}%"


def _count(counters: dict[str, float], name: str) -> str:
    return f"{counters[name]:.0f}" if name in counters else "-"


def render(plane: dict[str, Any], console: Console) -> None:
    announced = plane["announcement"]
    if announced is None and not plane["versions"]:
        console.print(f"job {plane['job_id']}: no weights published yet")
    elif announced is not None:
        console.print(
            f"job {plane['job_id']}: version {announced['version']} announced "
            f"(trainer epoch {announced['trainer_epoch']}, over {announced['transport']})"
        )
    if plane["versions"]:
        table = Table("VERSION", "EPOCH", "SIZE", "BUCKETS", "CHECKSUM", "AGE", "HOLDERS", box=None)
        for v in plane["versions"]:
            m = v["manifest"] or {"error": "no manifest"}
            holders = "\n".join(_holder_cell(h) for h in v["holders"]) or "none"
            if "error" in m:
                table.add_row(str(v["version"]), "-", "-", "-", "-", m["error"], holders)
                continue
            table.add_row(
                str(v["version"]),
                str(m["trainer_epoch"]),
                size(m["total_bytes"]),
                str(m["buckets"]),
                m["checksum_algorithm"],
                age(m["published_at"]) if m["published_at"] else "-",
                holders,
            )
        console.print(table)
    members = plane["members"]
    if members is None:
        console.print("no monitor answered: members' pulls unknown")
        return
    if not members:
        console.print("no member of this job is heard by the monitor")
        return
    table = Table(
        "MEMBER", "PHASE", "VERSION", "PULLING", "PULLS", "BAD", "LOST", "SERVED", box=None
    )
    for m in members:
        counters = m["counters"]
        alive = m.get("state", "ALIVE") == "ALIVE"
        # A trainer publishes and never pulls: its pull columns are empty, not zeros.
        pulls = counters if m.get("role") != "trainer" else {}
        table.add_row(
            m["instance_id"],
            (m["phase"] or "-") if alive else m["state"].lower(),  # its last beat's figures
            _count(counters, "weight_version"),
            _pull_cell(pulls),
            _count(pulls, "weights_pulls"),
            _count(pulls, "weights_checksum_failures"),
            _count(pulls, "weights_source_failures"),
            size(counters["weights_bytes_served"]) if "weights_bytes_served" in counters else "-",
        )
    console.print(table)
    console.print(
        "BAD: buckets that failed their checksum (pulled again elsewhere); LOST: sources lost "
        "mid-pull; SERVED: bytes sent to other members"
    )


async def run(client: StackClient, args: argparse.Namespace, console: Console) -> int:
    request = coordinator_pb2.GetJobRequest(job_id=args.job)
    await client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE))  # a known job?
    plane = await weight_plane(client, args.job)
    if args.json:
        emit_json(plane)
        return 0
    render(plane, console)
    return 0
