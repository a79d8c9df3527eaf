"""A weight-plane peer in its own process, driven by the UCX transport tests.

Run as `python -m tests.support.ucx_peer --endpoints ... --prefix ... --instance ...`.
It starts a UcxTransport, prints {"event": "ready", "address": ...} on stdout, then answers
one JSON command per stdin line with one JSON reply line carrying the command's "id".
Stdout carries only those lines; logs go to stderr. Commands:

    publish {version, seed, bulk_mib?}  pack and publish make_tensors(seed, bulk_mib) (trainer)
    hold {version, seed}           serve make_tensors(seed) as a relay of version
    pull {version, save?, keep?}   pull and verify; reply with the tensors' digest, counters,
                                   the pull's seconds;
                                   keep: hold on to the tensors (as a slow caller would)
    kept {}                        the digest of each kept pull's tensors, now
    fetch_latest {}                the existing flow: latest Announcement, then fetch()
    ask {address, version, buckets} ask a holder directly; reply with its error code/message
    wait_served {buckets}          reply once this process has served that many buckets
    latest {}                      the newest version from the highest trainer epoch
    state {}                       counters, held versions, versions its watch listed
    lag {version, holder}          drop holder's record of version from this process's view
                                   only, as if its watch had not delivered it yet
    gate_txns {}                   hold this transport's etcd transactions until ungate_txns,
                                   as a slow etcd would (each waits before it is sent)
    ungate_txns {}                 let them go
    close {}                       close the transport, keep the process (commands that need
                                   a transport fail until reopen)
    reopen {}                      start a new transport like the first; reply with its address
    exit {}                        close the transport and exit

With --probe-transport it only prints which transport make_transport("ucx") chose and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from typing import Any

import torch

from robustrl.contracts.errors import RobustrlError
from robustrl.contracts.keys import KeySpace, WeightKeys
from robustrl.core.config import EtcdSettings
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.logs import configure_logging
from robustrl.core.watch import Delete
from robustrl.weights.protocol import HolderRefused
from robustrl.weights.transport import (
    PULL_PROGRESS_EVERY_S,
    NamedTensors,
    WeightIntegrityError,
    latest_announcement,
)
from robustrl.weights.ucx.connections import PARK_SECONDS, ask_holder
from robustrl.weights.ucx.holder import HolderFaults
from robustrl.weights.ucx.records import PULLERS_RECORD_DELAY_S
from robustrl.weights.ucx.transport import UcxTransport, load_ucxx, make_transport
from tests.support import eventually


def make_tensors(seed: int, bulk_mib: int = 0) -> NamedTensors:
    """A small model-like set: several dtypes, a 0-d, an empty and a non-contiguous tensor;
    with bulk_mib, one more tensor of that many MiB, for pulls that take a while."""
    gen = torch.Generator().manual_seed(seed)
    bulk = [("bulk", torch.full((bulk_mib << 20,), seed, dtype=torch.uint8))] if bulk_mib else []
    return [
        *bulk,
        ("embed.weight", torch.randn(4096, 128, generator=gen)),
        ("layers.0.attn.bf16", torch.randn(256, 96, generator=gen).to(torch.bfloat16)),
        ("layers.0.mlp.half_t", torch.randn(64, 48, generator=gen).to(torch.float16).t()),
        ("layers.0.ids", torch.randint(-(2**40), 2**40, (1000,), generator=gen)),
        ("mask", torch.rand(333, generator=gen) > 0.5),
        ("scalar", torch.tensor(float(seed) + 0.25, dtype=torch.float64)),
        ("empty", torch.empty(0, 7)),
        ("raw", torch.randint(0, 256, (12345,), generator=gen, dtype=torch.uint8)),
    ]


def tensors_digest(tensors: NamedTensors) -> str:
    """Equal digests mean the same names, dtypes, shapes and bytes, in order."""
    hasher = hashlib.sha256()
    for name, tensor in tensors:
        hasher.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        hasher.update(flat.numpy().tobytes())
    return hasher.hexdigest()


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--job", default="job-1")
    parser.add_argument("--instance", required=True)
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=256 << 10)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--no-relay", action="store_true")
    parser.add_argument("--corrupt", default="", help="comma-separated bucket indexes")
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--pull-timeout", type=float, default=30.0)
    parser.add_argument("--stall-timeout", type=float, default=15.0)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument("--record-delay", type=float, default=PULLERS_RECORD_DELAY_S)
    parser.add_argument("--max-pullers", type=int, default=0, help="0: no limit")
    parser.add_argument("--park-seconds", type=float, default=PARK_SECONDS)
    parser.add_argument("--progress-every", type=float, default=PULL_PROGRESS_EVERY_S)
    parser.add_argument("--device", default="cpu", help="where published and pulled tensors live")
    parser.add_argument(
        "--checksum", default=None, help="the publisher's checksum algorithm (default: by device)"
    )
    parser.add_argument(
        "--probe-transport",
        action="store_true",
        help="print which transport make_transport('ucx') gives here, then exit",
    )
    return parser.parse_args(argv)


_gates: list[asyncio.Event] = []  # gate_txns


async def _handle(
    transport: UcxTransport,
    client: Any,
    keys: KeySpace,
    args: argparse.Namespace,
    cmd: dict[str, Any],
    kept: dict[int, NamedTensors],
) -> dict[str, Any]:
    op, job = cmd["cmd"], args.job
    if op == "publish":
        made = make_tensors(int(cmd["seed"]), int(cmd.get("bulk_mib", 0)))
        tensors = [(n, t.to(args.device)) for n, t in made]
        try:
            await transport.publish(int(cmd["version"]), tensors)
        except RobustrlError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}
    if op == "hold":
        tensors = [(n, t.to(args.device)) for n, t in make_tensors(int(cmd["seed"]))]
        try:
            await transport.hold(int(cmd["version"]), tensors)
        except WeightIntegrityError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}
    if op in ("pull", "fetch_latest"):
        try:
            if op == "pull":
                started = time.perf_counter()
                tensors = await transport.pull(job, int(cmd["version"]), device=args.device)
                pull_s = time.perf_counter() - started
            else:
                announcement = await latest_announcement(client, keys, job)
                if announcement is None:
                    return {"ok": False, "error": "nothing announced"}
                tensors = await transport.fetch(announcement)
        except (WeightIntegrityError, RobustrlError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if op == "pull" and not args.no_relay:
            # A relay registers in the background after the pull; tests that pull from it next
            # need the record.
            key = WeightKeys(keys).holder(job, int(cmd["version"]), args.instance)

            async def registered() -> bool:
                return await client.get(key) is not None

            await eventually(registered, timeout=10, interval=0.005)
        if cmd.get("save"):
            torch.save([(n, t.clone()) for n, t in tensors], cmd["save"])
        if cmd.get("keep"):
            kept[int(cmd["version"])] = tensors
        return {
            "ok": True,
            "device": tensors[0][1].device.type,
            "digest": tensors_digest(tensors),
            "counters": transport.counters.as_dict(),
            **({"seconds": pull_s} if op == "pull" else {}),
        }
    if op == "ask":
        try:
            sizes = await ask_holder(
                load_ucxx(),
                cmd["address"],
                job,
                int(cmd["version"]),
                buckets=cmd.get("buckets", [0]),
            )
        except HolderRefused as exc:
            return {"ok": False, "code": exc.code, "message": exc.message, "held": exc.held}
        except Exception as exc:  # the holder hung up or never answered
            return {"ok": False, "code": "failed", "message": repr(exc)}
        return {"ok": True, "sizes": sizes}
    if op == "wait_served":
        wanted = int(cmd["buckets"])

        async def served() -> bool:
            return transport.counters.buckets_served >= wanted

        await eventually(served, timeout=60, interval=0.01)
        return {"ok": True}
    if op == "kept":
        return {"ok": True, "digests": {v: tensors_digest(t) for v, t in kept.items()}}
    if op == "latest":
        return {"ok": True, "version": await transport.latest_version()}
    if op == "state":
        return {
            "ok": True,
            "counters": transport.counters.as_dict(),
            "held": transport.held_versions(),
            "listed": transport.listed_versions(),
            "serving": len(transport.server.endpoints),  # pullers' endpoints open on this holder
        }
    if op == "lag":
        # The view is the transport's own; no production path edits it from outside.
        view = transport.directory.view
        view.apply(Delete(WeightKeys(keys).holder(job, int(cmd["version"]), cmd["holder"]), 0))
        return {"ok": True, "listed": transport.listed_versions()}
    if op == "gate_txns":
        gate = asyncio.Event()
        send = transport.client.transaction

        async def gated(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await send(*args, **kwargs)

        # Shadows the method on this process's client only; the transactions still go to etcd.
        setattr(transport.client, "transaction", gated)  # noqa: B010
        _gates.append(gate)
        return {"ok": True}
    if op == "ungate_txns":
        delattr(transport.client, "transaction")
        _gates.pop().set()
        return {"ok": True}
    raise ValueError(f"unknown command {op!r}")


async def main(argv: list[str]) -> None:
    args = _parse_args(argv)
    configure_logging(service="ucx-peer", instance=args.instance)  # logs to stderr
    settings = EtcdSettings(endpoints=args.endpoints, prefix=args.prefix, session_ttl=2)
    client = await connect_etcd(settings)
    keys = KeySpace(args.prefix)
    if args.probe_transport:
        chosen = await make_transport("ucx", client, keys, args.job, instance_id=args.instance)
        print(json.dumps({"event": "transport", "name": chosen.name}), flush=True)
        if isinstance(chosen, UcxTransport):
            await chosen.close()
        await client.close()
        return
    transport = _transport(args, client, keys)
    await transport.start()
    print(json.dumps({"event": "ready", "address": transport.address}), flush=True)
    kept: dict[int, NamedTensors] = {}
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            if cmd["cmd"] in ("close", "reopen"):
                await transport.close()
                if cmd["cmd"] == "reopen":
                    transport = _transport(args, client, keys)
                    await transport.start()
                reply = {"ok": True, "address": transport.address}
            else:
                reply = await _handle(transport, client, keys, args, cmd, kept)
            print(json.dumps({"id": cmd.get("id"), **reply}), flush=True)
    finally:
        await transport.close()
        await client.close()
    print(json.dumps({"event": "exited"}), flush=True)


def _transport(args: argparse.Namespace, client: Any, keys: KeySpace) -> UcxTransport:
    corrupt = frozenset(int(i) for i in args.corrupt.split(",") if i)
    return UcxTransport(
        client,
        keys,
        args.job,
        instance_id=args.instance,
        epoch=args.epoch,
        bucket_bytes=args.bucket_bytes,
        keep_versions=args.keep,
        relay=not args.no_relay,
        session_ttl=2,
        pull_timeout=args.pull_timeout,
        stall_timeout=args.stall_timeout,
        connect_timeout=args.connect_timeout,
        record_delay=args.record_delay,
        max_pullers=args.max_pullers,
        park_seconds=args.park_seconds,
        progress_every_s=args.progress_every,
        checksum_algorithm=args.checksum,
        faults=HolderFaults(corrupt_buckets=corrupt, stall_after_buckets=args.stall_after),
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
