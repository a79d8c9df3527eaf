"""Weight transfer throughput: our UCX transport against its ceiling and its baselines.

One run measures, per payload size, side by side:
  memcpy        an in-process tensor copy (the memory ceiling of this host)
  plain ucxx    ucxx tagged send/recv of the same bytes in the same bucket size, between two
                processes, on an open endpoint into a ready buffer, as many buckets posted
                ahead on each side as the transport posts (the transport's ceiling)
  + verify      the same plain ucxx, checking each bucket as it lands exactly as the
                transport does (checksums.LandedChecks, the transport's algorithm), over an
                endpoint of the worker the transport pulls on (ucx/progress.pull_context unless
                ROBUSTRL_UCX_PULL_THREAD=0): the ceiling of a verified pull (ours/+verify is
                what our bookkeeping costs)
  ours          UcxTransport.pull of a freshly published version, as a running rollout does
                it: manifest and holders as its etcd watch delivered them, pull the buckets
                over the endpoint kept from the last pull into the receive buffer the last
                pull's tensors left free, xxh3 every bucket, return the tensors ("ours
                again": the same version pulled a second time; "ours cold": the first pull
                at this size, into a new buffer, and at the first size over a new endpoint)
  grpc stream   GrpcStreamTransport.fetch through a real gRPC server (the fallback/baseline)
and the sender's CPU seconds per GB it served, plain ucxx and ours (both send and wait as
the transport's holder does, ucx/progress.send): what serving costs a trainer that trains
at the same time,
and then fans versions out to N pullers: all from the trainer (serving them all at once, or
one at a time), and with relays (the trainer serves one puller at a time; pullers that are
done serve the others). One at a time stands for a trainer whose link is the bottleneck.
The first version reaches pullers just started (as at a job's start); --repeat more reach
them warm, as each training step does.

Sender and receivers are separate processes (this file re-run with --worker), with an etcd of
their own. Throughput is payload bytes / wall seconds (GB = 1e9 B); each point is the median
(or, with --stat best, the fastest) of --repeat runs. Ours/plain and ours/+verify are also
given as the median of the ratios within each repeat (the three measured back to back), which
other work on the host skews less.

    python benchmarks/weight_transfer.py                      # 64 and 256 MiB, fan-out to 4
    python benchmarks/weight_transfer.py --sizes 64,256,1024  # the full list (~12 GiB RAM)
    python benchmarks/weight_transfer.py --device cuda        # GPU buffers on both sides
    python benchmarks/weight_transfer.py --device cuda --checksum imm128   # another checksum

With --device cuda every buffer of ours, plain ucxx and memcpy lives in GPU memory (UCX moves
it device to device); the gRPC stream still serves and receives host copies, as it does for a
GPU trainer.

It also prints where ours' time went, the median of each part of its pulls (reading the
manifest, the request's round trip, receiving, and of that the wait for the first bucket and
the loop's time checking buckets as they landed, verifying after the last bucket) beside plain
ucxx's whole pull and its own wait for the first bucket: at GPU speed fixed costs per pull, not
the bytes, set ours/plain; on a host the hashes (the last bucket's after its last byte) weigh
most. Plain ucxx's wait is until its event loop saw the first bucket: on a host, where its
worker copies inside the loop's progress call, one call can copy several buckets first (at 64
MiB on 2 cores it saw the first bucket with the second: 4.86 of a 4.88 ms pull), so compare it
with ours' only on a GPU. BENCH_LOG_LEVEL=info makes the workers log every transfer, with the
same parts (`weights.pulled`: manifest_s, request_s, receive_s, check_s, first_s, verify_wait_s);
--keep-logs DIR keeps their logs (otherwise only a dead worker's log tail is printed); --json
FILE writes every point with its raw samples. --in-flight N posts N buckets ahead on each
endpoint, ours and plain ucxx alike, instead of the transport's IN_FLIGHT_BUCKETS.

Within one host, verification is what separates ours from plain ucxx: UCX copies each
message inside the progress call of the receiving worker (CMA, one copy, see
ucx/transport._ucx_env_defaults), and the puller hashes each bucket on its event loop's
thread. On hosts without CUDA both ours and "+verify" pull on a worker of their own that a
thread progresses (ucx/progress.pull_context): the copy of one bucket runs beside the hash of
the last. With ROBUSTRL_UCX_PULL_THREAD=0 both use ucxx's worker, which the event loop's
thread progresses: there the hash adds to the copy.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from children import Child, start_etcd, stop_etcd  # noqa: E402 (a sibling script's module)

MIB = 1 << 20
UCX_JOB = "bench-ucx"
GRPC_JOB = "bench-grpc"
TENSOR_BYTES = 16 * MIB  # the payload is cut into model-like tensors of this size


def make_payload(nbytes: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random bytes shaped as float32/bfloat16 tensors (bit patterns only, never computed)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for i, start in enumerate(range(0, nbytes, TENSOR_BYTES)):
        size = min(TENSOR_BYTES, nbytes - start)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        out.append((f"layers.{i}.weight", raw.view(dtype)))
    return out


# =========================================================================== worker side


class Worker:
    """One benchmark process: a weight sender or receiver, driven over stdin/stdout."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client: Any = None
        self.keys: Any = None
        self.ucx: Any = None
        self.grpc_transport: Any = None
        self.grpc_server: Any = None
        self.grpc_address = ""
        self.plain_listener: Any = None
        self.plain_buffer: torch.Tensor | None = None
        self.plain_eps: dict[bool, Any] = {}  # verify -> endpoint (see do_plain)
        self.plain_recv: torch.Tensor | None = None
        self.device = torch.device(args.device)
        self.payload: list[tuple[str, torch.Tensor]] = []

    async def start(self) -> dict[str, Any]:
        from robustrl.contracts.keys import KeySpace
        from robustrl.core.config import EtcdSettings
        from robustrl.core.etcd_client import connect_etcd
        from robustrl.core.logs import configure_logging
        from robustrl.weights.ucx.transport import UcxTransport

        level = os.environ.get("BENCH_LOG_LEVEL", "warning")
        configure_logging(service="bench", instance=self.args.instance, level=level)
        settings = EtcdSettings(endpoints=self.args.endpoints, prefix="/bench")
        self.client = await connect_etcd(settings)
        self.keys = KeySpace("/bench")
        self.ucx = UcxTransport(
            self.client,
            self.keys,
            UCX_JOB,
            instance_id=self.args.instance,
            bucket_bytes=self.args.bucket_mib * MIB,
            keep_versions=1,
            relay=self.args.relay,
            max_pullers=self.args.max_pullers,
            pull_timeout=300,
            checksum_algorithm=checksum_of(self.args),
            in_flight=in_flight(self.args),
        )
        await self.ucx.start()
        return {"address": self.ucx.address}

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        handler = getattr(self, f"do_{op}")
        result: dict[str, Any] = await handler(cmd)
        return result

    # ---------------------------------------------------------------- sender

    async def do_publish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Hold one payload three ways: UCX transport, gRPC transport, plain ucxx."""
        from robustrl.weights.grpc_stream import GrpcStreamTransport
        from robustrl.weights.ucx import listeners as ucx_listeners
        from robustrl.weights.ucx.buffers import allocate_buffer
        from robustrl.weights.ucx.transport import load_ucxx

        nbytes, version = int(cmd["bytes"]), int(cmd["version"])
        # Off the event loop: making a GiB of random bytes there kept the session's keepalive
        # from running, and the sender lost its etcd lease.
        host_tensors = await asyncio.to_thread(self._payload, nbytes, version)
        tensors = [(name, t.to(self.device)) for name, t in host_tensors]
        sync(self.device)
        started = time.perf_counter()
        await self.ucx.publish(version, tensors)
        publish_s = time.perf_counter() - started
        if cmd.get("grpc", True):
            if self.grpc_server is None:
                await self._start_grpc()
            self.grpc_transport = GrpcStreamTransport(
                self.client, self.keys, GRPC_JOB, address=self.grpc_address, epoch=0
            )
            await self.grpc_transport.publish(version, host_tensors)
        if cmd.get("plain", True):
            ucxx = load_ucxx()
            self.plain_buffer = allocate_buffer(nbytes, self.device)
            await asyncio.to_thread(self._fill_random, self.plain_buffer)
            sync(self.device)
            if self.plain_listener is None:
                self.plain_listener = ucx_listeners.borrow(ucxx, self._plain_serve)
        plain_port = self.plain_listener.port if self.plain_listener is not None else 0
        return {"publish_s": publish_s, "plain_address": f"127.0.0.1:{plain_port}"}

    @staticmethod
    def _fill_random(buffer: torch.Tensor) -> None:
        buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8))

    def _payload(self, nbytes: int, version: int) -> list[tuple[str, torch.Tensor]]:
        """The payload of this size, made once: random bytes take about 3 s a GiB here, and a
        publish that waited for them left a gap between pulls longer than a puller keeps its
        endpoint (PARK_SECONDS). Each version is stamped into the first 8 bytes of every
        tensor, so every bucket's bytes and checksum change as a new version's would."""
        if sum(t.numel() * t.element_size() for _, t in self.payload) != nbytes:
            self.payload = make_payload(nbytes, seed=nbytes)
        stamp = torch.tensor(list(version.to_bytes(8, "little")), dtype=torch.uint8)
        for _, tensor in self.payload:
            tensor.view(torch.uint8)[:8] = stamp
        return self.payload

    async def _start_grpc(self) -> None:
        """A gRPC server with only Trainer.PullWeights, delegated to GrpcStreamTransport.serve
        exactly as the trainer's servicer does."""
        from robustrl.weights.grpc_stream import start_weight_server

        def serve(request: Any) -> AsyncIterator[Any]:
            return self.grpc_transport.serve(request)

        self.grpc_server, self.grpc_address = await start_weight_server(serve)

    async def _plain_serve(self, ep: Any) -> None:
        """Plain ucxx: on each request, send the buffer in bucket-sized tagged messages, as
        many posted ahead as the transport's holder posts (`in_flight`).

        It waits for the next request, and for its sends, as the transport's holder does
        (ucx_progress.receive_message and send): ucxx's own recv_obj and send poll on every turn
        of the loop, and the spinning took a core from the puller. With ucxx's send, plain
        ucxx verified on the pulling thread (two busy threads on the puller) ran at 0.5-0.6 of
        unverified, below ours."""
        from robustrl.weights.ucx import progress as ucx_progress
        from robustrl.weights.ucx.buffers import ucx_buffer

        posted_ahead = in_flight(self.args)
        with contextlib.suppress(Exception):
            while True:
                request = json.loads(await ucx_progress.receive_message(ep, 1 << 16))
                assert self.plain_buffer is not None
                bucket = int(request["bucket"])
                sends: collections.deque[asyncio.Future[Any]] = collections.deque()
                for i, start in enumerate(range(0, int(request["bytes"]), bucket)):
                    view = self.plain_buffer[start : start + bucket]
                    send = ucx_progress.send(ep, ucx_buffer(view), i)
                    sends.append(asyncio.ensure_future(send))
                    if len(sends) >= posted_ahead:
                        await sends.popleft()
                await asyncio.gather(*sends)

    async def do_cpu(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """CPU seconds this process has used so far, all threads."""
        return {"seconds": time.process_time()}

    async def do_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"counters": self.ucx.counters.as_dict(), "held": self.ucx.held_versions()}

    # ---------------------------------------------------------------- receiver

    async def do_ucx_pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        tensors = await self.ucx.pull(UCX_JOB, int(cmd["version"]), device=self.device)
        seconds = time.perf_counter() - started
        del tensors
        assert self.ucx.last_pull is not None  # every completed pull sets it
        return {
            "seconds": seconds,
            "counters": self.ucx.counters.as_dict(),
            "parts_s": dataclasses.asdict(self.ucx.last_pull),
        }

    async def do_grpc_fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from robustrl.weights.grpc_stream import GrpcStreamTransport
        from robustrl.weights.transport import latest_announcement

        transport = GrpcStreamTransport(self.client, self.keys, GRPC_JOB, address="", epoch=0)
        announcement = await latest_announcement(self.client, self.keys, GRPC_JOB)
        assert announcement is not None and announcement.version == int(cmd["version"])
        started = time.perf_counter()
        tensors = await transport.fetch(announcement)
        seconds = time.perf_counter() - started
        del tensors
        return {"seconds": seconds}

    async def do_plain(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from robustrl.weights.checksums import LandedChecks
        from robustrl.weights.ucx import progress as ucx_progress
        from robustrl.weights.ucx.buffers import allocate_buffer, ucx_buffer
        from robustrl.weights.ucx.transport import load_ucxx

        ucxx = load_ucxx()
        nbytes, bucket = int(cmd["bytes"]), int(cmd["bucket"])
        # With verify, each bucket is checked as it lands, as the transport does it, over an
        # endpoint of the worker the transport pulls on: the same verification work as ours,
        # with none of its bookkeeping. Plain ucxx uses ucxx's own worker.
        verify = bool(cmd.get("verify"))
        endpoint = self.plain_eps.get(verify)
        if endpoint is None:
            host, _, port = cmd["address"].rpartition(":")
            maker = self.ucx.endpoints_for_pulls() if verify else ucxx
            endpoint = self.plain_eps[verify] = await maker.create_endpoint(host, int(port))
        if self.plain_recv is None or self.plain_recv.numel() != nbytes:
            self.plain_recv = allocate_buffer(nbytes, self.device)
        algorithm = checksum_of(self.args)
        checks = LandedChecks(algorithm, self.ucx._pool)
        receives: collections.deque[tuple[int, torch.Tensor, asyncio.Future[Any]]] = (
            collections.deque()
        )

        first_s = 0.0

        async def land() -> None:
            nonlocal first_s
            index, view, receive = receives.popleft()
            await receive
            if not first_s:
                first_s = time.perf_counter() - started
            if verify:
                checks.landed(index, view)

        posted_ahead = in_flight(self.args)
        started = time.perf_counter()
        with ucx_progress.pulling():  # the worker kept hot as for our pulls
            request = json.dumps({"bytes": nbytes, "bucket": bucket}).encode()
            await ucx_progress.send_message(endpoint, request)  # one message, as ours sends
            # As many receives posted ahead as the transport posts (`in_flight`).
            for i, start in enumerate(range(0, nbytes, bucket)):
                view = self.plain_recv[start : start + bucket]
                receives.append(
                    (i, view, asyncio.ensure_future(endpoint.recv(ucx_buffer(view), tag=i)))
                )
                if len(receives) >= posted_ahead:
                    await land()
            while receives:
                await land()
            await checks.results()
        return {"seconds": time.perf_counter() - started, "first_s": first_s}

    async def do_plain_reset(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for endpoint in self.plain_eps.values():
            endpoint.abort()
        self.plain_eps.clear()
        self.plain_recv = None
        return {}

    async def close(self) -> None:
        from robustrl.weights.ucx import listeners as ucx_listeners

        for endpoint in self.plain_eps.values():
            endpoint.abort()
        if self.plain_listener is not None:
            ucx_listeners.give_back(self.plain_listener)
        if self.grpc_server is not None:
            await self.grpc_server.stop(0)
        await self.ucx.close()
        await self.client.close()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_flight(args: argparse.Namespace) -> int:
    """Buckets posted ahead on an endpoint, ours and plain ucxx alike: --in-flight, or the
    transport's IN_FLIGHT_BUCKETS."""
    from robustrl.weights.protocol import IN_FLIGHT_BUCKETS

    return int(args.in_flight) or IN_FLIGHT_BUCKETS


async def worker_main(args: argparse.Namespace) -> None:
    worker = Worker(args)
    ready = await worker.start()
    print(json.dumps({"event": "ready", **ready}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or json.loads(line)["cmd"] == "exit":
                break
            cmd = json.loads(line)
            reply = await worker.handle(cmd)
            print(json.dumps({"id": cmd["id"], **reply}), flush=True)
    finally:
        await worker.close()


# =========================================================================== driver side


class Proc(Child):
    """A worker process as the driver sees it; `info` is what it said when ready."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        super().__init__(name, proc, log)
        self.info: dict[str, Any] = {}


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.endpoints = ""
        self.etcd: subprocess.Popen[bytes] | None = None
        self.procs: list[Proc] = []

    def start_etcd(self) -> None:
        self.etcd, self.endpoints = start_etcd(self.workdir)

    async def spawn(self, *specs: tuple[str, bool, int]) -> list[Proc]:
        """Start workers side by side: (instance, relay, max_pullers) each."""
        group = []
        for name, relay, max_pullers in specs:
            log = self.workdir / f"{name}.log"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--worker",
                "--endpoints",
                self.endpoints,
                "--instance",
                name,
                "--bucket-mib",
                str(self.args.bucket_mib),
                "--device",
                self.args.device,
                "--checksum",
                self.args.checksum,
                "--in-flight",
                str(self.args.in_flight),
                "--max-pullers",
                str(max_pullers),
                *(["--relay"] if relay else []),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log.open("wb"),
            )
            group.append(Proc(name, proc, log))
        self.procs.extend(group)
        for p in group:
            message = await p.line(120)
            p.info = message
        return group

    async def stop(self, procs: list[Proc]) -> None:
        await asyncio.gather(*(p.stop() for p in procs))
        for p in procs:
            self.procs.remove(p)

    async def close(self) -> None:
        await self.stop(list(self.procs))
        stop_etcd(self.etcd)


def memcpy_gbps(nbytes: int, repeat: int, device: torch.device) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch outside the timing
    sync(device)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def checksum_of(args: argparse.Namespace) -> str:
    """The bucket checksum the run uses: --checksum, or what a publisher picks by device."""
    from robustrl.weights.checksums import algorithm_for

    return algorithm_for(args.device) if args.checksum == "auto" else str(args.checksum)


def checksum_gbps(
    nbytes: int, bucket: int, device: torch.device, threads: int, algorithm: str
) -> float:
    """What bucket checksums alone reach here on `threads` threads (the publisher hashes on
    the transport's pool; a puller hashes host buckets on one thread, its event loop's).

    Warm, as in a pull: an untimed pass first makes wsum128's coefficients and each thread's
    CUDA stream (timed, they made an H200's wsum128 read 0.7-4.5 GB/s on one thread against
    145-200 warm)."""
    from robustrl.weights.checksums import bucket_checksum

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    sync(device)
    views = [data[s : s + bucket] for s in range(0, nbytes, bucket)]
    algorithms = [algorithm] * len(views)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(bucket_checksum, views, algorithms))
        started = time.perf_counter()
        list(pool.map(bucket_checksum, views, algorithms))
        return nbytes / (time.perf_counter() - started) / 1e9


async def while_serving(
    sender: Proc, pull: Awaitable[dict[str, Any]]
) -> tuple[dict[str, Any], float]:
    """A receiver's reply to `pull`, and the CPU seconds the sender used while serving it."""
    before = (await sender.call("cpu"))["seconds"]
    reply = await pull
    return reply, (await sender.call("cpu"))["seconds"] - before


async def point_to_point(driver: Driver, sizes_mib: list[int]) -> list[dict[str, Any]]:
    """Per size, a first version warms plain ucxx (untimed) and times our first pull at that
    size ("cold"). Then each repeat publishes a new version (untimed) and times, side by side:
    plain ucxx, the first pull of that version (what a rollout does), a second pull of it (what
    the next puller of the same holder sees), and the gRPC fetch."""
    args = driver.args
    bucket = args.bucket_mib * MIB
    device = torch.device(args.device)
    sender, receiver = await driver.spawn(("trainer", False, 0), ("receiver", False, 0))
    rows = []
    version = 0
    try:
        for size_mib in sizes_mib:
            nbytes = size_mib * MIB
            times: dict[str, list[float]] = {
                key: [] for key in ("plain", "plain_verified", "ucx", "ucx_again", "grpc")
            }
            publish_s: list[float] = []
            parts_s: list[dict[str, float]] = []  # where each first pull's time went
            plain_first_s: list[float] = []  # plain ucxx: from its request to the first bucket
            # The sender's CPU seconds while it served each kind of pull, summed over repeats.
            serving_cpu = dict.fromkeys(("plain", "plain_verified", "ucx", "ucx_again"), 0.0)
            await receiver.call("plain_reset")
            version += 1
            published = await sender.call("publish", bytes=nbytes, version=version, grpc=False)
            plain_address = published["plain_address"]
            # Warm the endpoints and buffers, as a running pipeline's would be.
            for verify in (False, True):
                await receiver.call(
                    "plain", address=plain_address, bytes=nbytes, bucket=bucket, verify=verify
                )
            cold = (await receiver.call("ucx_pull", version=version))["seconds"]
            for _ in range(args.repeat):
                version += 1
                published = await sender.call(
                    "publish", bytes=nbytes, version=version, plain=False, grpc=False
                )
                publish_s.append(published["publish_s"])
                for key, verify in (("plain", False), ("plain_verified", True)):
                    plain, cpu = await while_serving(
                        sender,
                        receiver.call(
                            "plain",
                            address=plain_address,
                            bytes=nbytes,
                            bucket=bucket,
                            verify=verify,
                        ),
                    )
                    times[key].append(plain["seconds"])
                    serving_cpu[key] += cpu
                    if key == "plain":
                        plain_first_s.append(plain["first_s"])
                for key in ("ucx", "ucx_again"):
                    pulled, cpu = await while_serving(
                        sender, receiver.call("ucx_pull", version=version)
                    )
                    times[key].append(pulled["seconds"])
                    serving_cpu[key] += cpu
                    if key == "ucx":
                        parts_s.append(pulled["parts_s"])
            # The gRPC fetches in a loop of their own: at 1 GiB one takes longer than
            # PARK_SECONDS, and a UCX pull after it opened a new endpoint instead of using the
            # one kept by a pipeline that pulls every step (ours read 8.8-9.3 GB/s at 1 GiB so,
            # 10.7 with the endpoint kept, on 2 cores).
            for _ in range(args.repeat):
                version += 1
                await sender.call("publish", bytes=nbytes, version=version, plain=False)
                times["grpc"].append(
                    (await receiver.call("grpc_fetch", version=version))["seconds"]
                )
            row: dict[str, Any] = {
                "size_mib": size_mib,
                "memcpy": memcpy_gbps(nbytes, args.repeat, device),
            }
            pick = min if args.stat == "best" else statistics.median
            row.update({k: nbytes / pick(v) / 1e9 for k, v in times.items()})
            row["samples_s"] = times
            row["ucx_cold"] = nbytes / cold / 1e9
            row["publish"] = nbytes / pick(publish_s) / 1e9
            row["ucx_parts_ms"] = {
                part: 1e3 * statistics.median(p[part] for p in parts_s) for part in parts_s[0]
            }
            row["plain_first_ms"] = 1e3 * statistics.median(plain_first_s)
            served_gb = nbytes * args.repeat / 1e9
            row["serving_cpu_per_gb"] = {k: v / served_gb for k, v in serving_cpu.items()}
            rows.append(row)
            print(f"  measured {size_mib} MiB", file=sys.stderr, flush=True)
    finally:
        await receiver.call("plain_reset")
        await driver.stop([sender, receiver])
    return rows


FAN_MODES = (
    # (label, pullers relay, trainer serves at most this many at once: 0 = any number)
    ("all from the trainer, at once", False, 0),
    ("all from the trainer, 1 at a time", False, 1),
    ("relays, trainer serves 1 at a time", True, 1),
)


async def fan_out(
    driver: Driver, size_mib: int, pullers: int, mode: tuple[str, bool, int]
) -> dict[str, Any]:
    """Time until all pullers hold a version. With relays every puller that is done serves
    the others (ties go to relays). A trainer that serves one puller at a time stands for a
    trainer whose link is the bottleneck, as between hosts: on one host every transfer shares
    the same cores and memory, so serving all at once is the fastest here.

    The first version reaches pullers that have just started (new endpoints, new buffers),
    as at a job's start; each of --repeat versions after it reaches them warm, as every
    training step does. The figures are the median (or fastest) of those."""
    label, relays, max_pullers = mode
    specs = [("trainer", False, max_pullers)]
    specs += [(f"puller-{i}", relays, 0) for i in range(pullers)]
    trainer, *group = await driver.spawn(*specs)
    times: list[float] = []
    shares: list[float] = []
    try:
        # The share is counted where each bucket was verified, by source: the trainer's own
        # count of buckets served lags, as it hears of a send's end after the puller has the
        # bucket (a round once came out at 125% so).
        from_trainer_before = pulled_before = 0
        for version in range(1, driver.args.repeat + 2):
            await trainer.call(
                "publish", bytes=size_mib * MIB, version=version, grpc=False, plain=False
            )
            started = time.perf_counter()
            ids = [p.send("ucx_pull", version=version) for p in group]
            replies = await asyncio.gather(*(p.reply(i) for p, i in zip(group, ids, strict=True)))
            times.append(time.perf_counter() - started)
            sources = [r["counters"]["buckets_by_source"] for r in replies]
            pulled = sum(sum(by.values()) for by in sources)
            from_trainer = sum(by.get(trainer.name, 0) for by in sources)
            shares.append((from_trainer - from_trainer_before) / (pulled - pulled_before))
            from_trainer_before, pulled_before = from_trainer, pulled
    finally:
        await driver.stop([trainer, *group])
    pick = min if driver.args.stat == "best" else statistics.median
    seconds = pick(times[1:])
    return {
        "mode": label,
        "first_seconds": times[0],
        "seconds": seconds,
        "gbps": pullers * size_mib * MIB / seconds / 1e9,
        "trainer_share": statistics.median(shares[1:]),
        "samples_s": times,
    }


def paired_ratio(row: dict[str, Any], ours: str, base: str) -> float:
    """Median over repeats of ours' throughput over base's, each pair from one repeat."""
    samples = row["samples_s"]
    return statistics.median(b / o for o, b in zip(samples[ours], samples[base], strict=True))


def print_report(
    rows: list[dict[str, Any]],
    fan: list[dict[str, Any]],
    args: argparse.Namespace,
    checksum: dict[int, float],
) -> None:

    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_"))}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    stat = f"{args.stat} of {args.repeat}"
    where = "GPU to GPU" if args.device == "cuda" else "host to host"
    print(
        f"\nweight transfer ({where}), bucket {args.bucket_mib} MiB, {in_flight(args)} in flight,"
        f" {stat}, GB/s"
    )
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}; grpc moves host copies")
    print(f"host: {os.cpu_count()} cpus, load average {load} (other work skews every column)")
    print(f"UCX env: {env or 'transport defaults'}")
    algorithm = checksum_of(args)
    header = (
        f"{'payload':>9} {'memcpy':>8} {'plain ucxx':>11} {'+verify':>8} {'ours':>8}"
        f" {'ours again':>11} {'ours cold':>10} {'grpc':>8} {'ours/plain':>11}"
        f" {'ours/+verify':>13} {'ours/grpc':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size_mib']:>5} MiB {r['memcpy']:>8.2f} {r['plain']:>11.2f}"
            f" {r['plain_verified']:>8.2f} {r['ucx']:>8.2f} {r['ucx_again']:>11.2f}"
            f" {r['ucx_cold']:>10.2f} {r['grpc']:>8.2f} {r['ucx'] / r['plain']:>11.2f}"
            f" {r['ucx'] / r['plain_verified']:>13.2f} {r['ucx'] / r['grpc']:>10.2f}"
        )
    print(
        f"+verify: plain ucxx that also {algorithm}s each bucket as it lands, as the transport"
        " does, over an endpoint\nof the worker the transport pulls on\n"
        "ours: first pull of a freshly published version; ours again: a second pull of it"
        " from the same holder;\nours cold: one pull, the first at this size (a new receive"
        " buffer; at the first size a new endpoint)"
    )
    serving = ", ".join(
        f"{r['size_mib']} MiB {r['serving_cpu_per_gb']['plain']:.3f} and"
        f" {r['serving_cpu_per_gb']['ucx']:.3f}"
        for r in rows
    )
    print(f"sender CPU seconds per GB served, plain ucxx and ours: {serving}")
    publish = ", ".join(f"{r['size_mib']} MiB {r['publish']:.2f}" for r in rows)
    print(f"UcxTransport.publish (pack, {algorithm}, etcd), GB/s: {publish}")
    pool_threads = max(checksum)
    print(
        f"({algorithm} alone, of {max(r['size_mib'] for r in rows)} MiB from memory, GB/s:"
        f" {checksum[1]:.2f} on one thread,"
        f" {checksum[pool_threads]:.2f} on the transport's pool of {pool_threads})"
    )
    # What verifying every byte leaves of plain ucxx on the worker the transport pulls on,
    # measured in this run: the most ours/plain can be, however lean the bookkeeping.
    verified = ", ".join(
        f"{r['size_mib']} MiB {r['plain_verified'] / r['plain']:.2f}" for r in rows
    )
    print(f"+verify/plain, on the worker ours pulls on: {verified}")
    # Each repeat measures plain ucxx, +verify and ours back to back: the ratio within a repeat
    # shares that moment's load, so the median of those ratios moves less than a ratio of
    # medians when other work comes and goes (the columns above).
    paired = ", ".join(
        f"{r['size_mib']} MiB {paired_ratio(r, 'ucx', 'plain'):.2f}"
        f" and {paired_ratio(r, 'ucx', 'plain_verified'):.2f}"
        for r in rows
    )
    print(f"ours/plain and ours/+verify, median of the ratios within each repeat: {paired}")
    # Fixed costs show here: at GPU speed they, not the bytes, set ours/plain.
    print("where ours' time went, median ms of its pulls (plain ucxx's whole pull beside it):")
    for r in rows:
        parts = r["ucx_parts_ms"]
        plain_ms = 1e3 * statistics.median(r["samples_s"]["plain"])
        print(
            f"  {r['size_mib']} MiB: manifest {parts['manifest_s']:.2f}, request"
            f" {parts['request_s']:.2f}, receive {parts['receive_s']:.2f} (of which until the"
            f" first bucket landed {parts['first_s']:.2f}, checking buckets as they landed"
            f" {parts['check_s']:.2f}), verify after the last bucket"
            f" {parts['verify_wait_s']:.2f} (plain ucxx {plain_ms:.2f}, of which until its"
            f" loop saw the first bucket {r['plain_first_ms']:.2f})"
        )
    if fan:
        print(
            f"\nfan-out of a {args.fanout_mib} MiB version to {args.pullers} pullers: the first"
            f" (pullers just started), then {stat} (pullers warm, as each step)"
        )
        print(
            f"{'mode':<36} {'first s':>8} {'seconds':>8} {'aggregate GB/s':>15}"
            f" {'from trainer':>13}"
        )
        for f in fan:
            print(
                f"{f['mode']:<36} {f['first_seconds']:>8.3f} {f['seconds']:>8.3f}"
                f" {f['gbps']:>15.2f} {f['trainer_share']:>12.0%}"
            )
        at_once, one_at_a_time, relayed = (f["seconds"] for f in fan)
        print(
            f"relays / trainer-only time, trainer serving 1 at a time: "
            f"{relayed / one_at_a_time:.2f}; against a trainer serving all at once: "
            f"{relayed / at_once:.2f}"
        )


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1))


def keep_logs(workdir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy(log, dest / log.name)


async def driver_main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="weight-bench-") as tmp:
        driver = Driver(args, Path(tmp))
        driver.start_etcd()
        try:
            rows = await point_to_point(driver, sizes)
            fan = []
            if args.pullers > 0:
                for mode in FAN_MODES:
                    fan.append(await fan_out(driver, args.fanout_mib, args.pullers, mode))
        finally:
            await driver.close()
            if args.keep_logs:
                keep_logs(Path(tmp), Path(args.keep_logs))
    from robustrl.weights.ucx.transport import DEFAULT_HASH_THREADS

    device = torch.device(args.device)
    checksum = {
        threads: checksum_gbps(
            max(sizes) * MIB, args.bucket_mib * MIB, device, threads, checksum_of(args)
        )
        for threads in sorted({1, DEFAULT_HASH_THREADS})
    }
    print_report(rows, fan, args, checksum)
    if args.json:
        write_json(Path(args.json), {"rows": rows, "fan_out": fan, "checksum_gbps": checksum})


def parse_args(argv: list[str]) -> argparse.Namespace:
    from robustrl.weights.checksums import CHECKSUM_ALGORITHMS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256", help="payload sizes in MiB (64,256,1024)")
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--stat",
        choices=("median", "best"),
        default="median",
        help="per point: the median run, or the fastest (on a host shared with other work)",
    )
    parser.add_argument("--pullers", type=int, default=4, help="fan-out pullers; 0 skips it")
    parser.add_argument("--fanout-mib", type=int, default=256)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where every buffer lives"
    )
    parser.add_argument(
        "--checksum",
        choices=("auto", *CHECKSUM_ALGORITHMS),
        default="auto",
        help="bucket checksum (auto: xxh3_128 on cpu, wsum128 on cuda, as a publisher picks)",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="buckets posted ahead on an endpoint, ours and plain ucxx alike"
        " (0: the transport's IN_FLIGHT_BUCKETS)",
    )
    parser.add_argument(
        "--json", default="", help="also write every point and its raw samples to this file"
    )
    parser.add_argument("--keep-logs", default="", help="copy the workers' logs into this folder")
    # Worker-side flags (the driver passes them).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    parser.add_argument("--instance", default="", help=argparse.SUPPRESS)
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-pullers", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])
    asyncio.run(worker_main(parsed) if parsed.worker else driver_main(parsed))
