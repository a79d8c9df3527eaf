"""The commands that inspect a running stack: members (the leader marked), incidents the
monitor recorded, the groups a job dropped, and a job's weight versions."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from robustrl.cli import weights
from robustrl.cli.client import DEFAULT_DEADLINE, StackClient
from robustrl.cli.context import with_client
from robustrl.cli.formatting import age, console, emit_json, plain_table
from robustrl.contracts.members import member_rank
from robustrl.v1 import coordinator_pb2


async def member_rows(client: StackClient) -> list[dict[str, Any]]:
    """Every member as `members --json` prints it: its record, its rank, whether it leads."""
    members = await client.members()
    leader = await client.leader()
    leader_id = leader["instance_id"] if leader else ""
    return [
        {**m.model_dump(), "rank": member_rank(m), "leader": m.instance_id == leader_id}
        for m in members
    ]


async def print_members(client: StackClient, as_json: bool) -> int:
    rows = await member_rows(client)
    if as_json:
        emit_json(rows)
        return 0
    if not rows:
        console.print("no members registered")
        return 0
    lines = [
        [
            row["role"],
            row["instance_id"],
            row["address"],
            str(row["pid"]),
            str(row["epoch"]),
            row["job_id"] or "-",
            "leader" if row["leader"] else "",
        ]
        for row in rows
    ]
    print(plain_table(["ROLE", "INSTANCE", "ADDRESS", "PID", "EPOCH", "JOB", ""], lines))
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    return with_client(args, lambda c: print_members(c, args.json))


def cmd_incidents(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        records = await client.incidents(args.job or "")
        if args.json:
            emit_json(records)
            return 0
        table = Table("WHEN", "KIND", "ROLE", "INSTANCE", "RANK", "JOB", "EVIDENCE", box=None)
        for r in records:
            table.add_row(
                age(r["detected_at"]),
                r["kind"],
                r["role"],
                r["instance_id"],
                str(r.get("rank", 0)),
                r["job_id"] or "-",
                r["evidence"],
            )
        console.print(table if records else "no incidents")
        return 0

    return with_client(args, run)


async def dropped_of(client: StackClient, job_id: str) -> dict[str, str]:
    """What `dropped JOB --json` prints: each group the job dropped, with why. NOT_FOUND for
    a job the coordinator does not know."""
    request = coordinator_pb2.GetJobRequest(job_id=job_id)
    await client.read(lambda s: s.GetJob(request, timeout=DEFAULT_DEADLINE))
    return await client.dropped_groups(job_id) or {}


def cmd_dropped(args: argparse.Namespace) -> int:
    async def run(client: StackClient) -> int:
        dropped = await dropped_of(client, args.job)
        if args.json:
            emit_json(dropped)
            return 0
        table = Table("GROUP", "WHY", box=None)
        for group, why in sorted(dropped.items()):
            table.add_row(group, why)
        console.print(table if dropped else f"job {args.job} dropped no group")
        return 0

    return with_client(args, run)


def cmd_weights(args: argparse.Namespace) -> int:
    """A job's weight versions and holders, and its members' pulls (robustrl/cli/weights.py)."""
    return with_client(args, lambda c: weights.run(c, args, console))
