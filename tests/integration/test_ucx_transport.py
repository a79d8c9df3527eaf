"""The UCX weight plane across real processes: real ucxx endpoints on loopback, real etcd.

Every trainer, relay and puller is its own process (tests/support/ucx_peer.py), forked from
one warm template per file and driven over stdin/stdout; the test kills them by pid. Tensors
are small (about 2 MiB in nine 256 KiB buckets): process start-up dominates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from robustrl.contracts.keys import KeySpace, WeightKeys
from robustrl.core.config import EtcdSettings
from robustrl.core.fences import withdraw_holder_records
from robustrl.core.watch import Delete, Entry, Put, Resync
from robustrl.weights.checksums import CHECKSUM_ALGORITHMS, WSUM128
from robustrl.weights.grpc_stream import GrpcStreamTransport
from robustrl.weights.protocol import (
    FRAME_BYTES,
    PROTOCOL_VERSION,
    ROLE_RELAY,
    ROLE_TRAINER,
    BucketEntry,
    BucketManifest,
    FrameError,
    HolderRecord,
    HolderRefused,
    ManifestTooLarge,
    bucket_ranges,
    manifest_for_etcd,
    plan_layout,
)
from robustrl.weights.transport import Announcement, WeightIntegrityError
from robustrl.weights.ucx import listeners as ucx_listeners
from robustrl.weights.ucx import progress as ucx_progress
from robustrl.weights.ucx.buffers import HostBuffers, allocate_buffer, pack_into, unpack_views
from robustrl.weights.ucx.connections import HolderConnection
from robustrl.weights.ucx.directory import VersionsView
from robustrl.weights.ucx.puller import choose_holder
from robustrl.weights.ucx.transport import UcxTransport, make_transport
from tests.support import eventually, stop_process, stopped
from tests.support.forked import ForkedProcess, Template, template
from tests.support.ucx_peer import make_tensors, tensors_digest

JOB = "job-1"
REPO = Path(__file__).resolve().parents[2]
N_BUCKETS = len(plan_layout(make_tensors(0), 256 << 10)[2])


class Peer:
    """One ucx_peer process: send a command, await its reply line."""

    def __init__(self, name: str, proc: ForkedProcess, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.address = ""
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise AssertionError(
                f"{self.name} exited; its log:\n{self.log_path.read_text()[-3000:]}"
            )
        message: dict[str, Any] = json.loads(line)
        return message

    async def ready(self, timeout: float = 30.0) -> None:
        message = await self._read(timeout)
        assert message.get("event") == "ready", message
        self.address = message["address"]

    def send(self, cmd: str, **fields: Any) -> int:
        assert self.proc.stdin is not None
        self._next_id += 1
        line = json.dumps({"cmd": cmd, "id": self._next_id, **fields}) + "\n"
        self.proc.stdin.write(line.encode())
        return self._next_id

    async def reply(self, request_id: int, timeout: float = 30.0) -> dict[str, Any]:
        while request_id not in self._replies:
            message = await self._read(timeout)
            self._replies[message["id"]] = message
        return self._replies.pop(request_id)

    async def call(self, cmd: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        return await self.reply(self.send(cmd, **fields), timeout)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture(scope="module")
def peer_template() -> Iterator[Template]:
    """The peers' warm template: they fork from it with torch and our code imported, instead of
    spending seconds of a core each on the imports (about 90 peers in this file)."""
    with template("tests.support.ucx_peer") as warm:  # not ucxx: UCX reads its environment then
        yield warm


@pytest.fixture
async def peers(
    etcd_settings: EtcdSettings, tmp_path: Path, peer_template: Template
) -> AsyncIterator[Any]:
    """A factory for peer processes; every one still running at the end is killed by pid."""
    started: list[Peer] = []

    async def spawn(name: str, *extra: str) -> Peer:
        log_path = tmp_path / f"{name}.log"
        args = ["--endpoints", etcd_settings.endpoints, "--prefix", etcd_settings.prefix]
        proc = await peer_template.spawn(
            "tests.support.ucx_peer",
            [*args, "--job", JOB, "--instance", name, *extra],
            {**os.environ, "PYTHONUNBUFFERED": "1"},
            log_path,
        )
        peer = Peer(name, proc, log_path)
        started.append(peer)
        return peer

    async def start(*specs: tuple[str, ...]) -> list[Peer]:
        """Start peers side by side (imports dominate start-up), then wait until all serve."""
        group = [await spawn(name, *extra) for name, *extra in specs]
        await asyncio.gather(*(p.ready() for p in group))
        return group

    yield start
    # A clean exit closes the transport (listener, endpoints, lease); kill only what hangs.
    for peer in started:
        if peer.proc.returncode is None:
            with contextlib.suppress(ConnectionError):
                peer.send("exit")
    for peer in started:
        try:
            await asyncio.wait_for(peer.proc.wait(), 10)
        except TimeoutError:
            peer.kill()
            await peer.proc.wait()


def _only_from(counters: dict[str, Any], source: str) -> bool:
    return counters["buckets_by_source"] == {source: N_BUCKETS}


async def _sees(peer: Peer, version: int, holder: str) -> None:
    """Until peer's watch lists holder for version. A pull's first listing comes from that
    watch, and the tests that assert which holder a pull picks need the holder in it."""

    async def listed() -> bool:
        return holder in (await peer.call("state"))["listed"].get(str(version), [])

    await eventually(listed, timeout=10)


def _logged(peer: Peer, event: str) -> list[dict[str, str]]:
    """The key=value fields of each line of `event` in peer's log (structlog's console
    format), in order."""
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in peer.log_path.read_text().splitlines()
        if f" {event} " in line
    ]


async def _manifest(client: Any, settings: EtcdSettings, version: int) -> BucketManifest:
    raw = (await client.get(WeightKeys(KeySpace(settings.prefix)).manifest(JOB, version))).value
    return BucketManifest.from_json(raw)


async def test_pulled_tensors_are_bitwise_identical(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    trainer, puller = await peers(("trainer", "--epoch", "3"), ("puller",))
    assert (await trainer.call("publish", version=1, seed=11))["ok"]

    saved = tmp_path / "pulled.pt"
    result = await puller.call("pull", version=1, save=str(saved))

    assert result["ok"], result
    expected = make_tensors(11)
    got = torch.load(saved, weights_only=True)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, want), (_, have) in zip(expected, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape, name
        want_bytes = want.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(have.contiguous().reshape(-1).view(torch.uint8), want_bytes), name
    assert _only_from(result["counters"], "trainer")
    # The manifest is in etcd with the trainer's epoch; both processes are holders now.
    wkeys = WeightKeys(KeySpace(etcd_settings.prefix))
    manifest = await _manifest(etcd_client, etcd_settings, 1)
    assert manifest.trainer_epoch == 3 and len(manifest.buckets) == N_BUCKETS
    holders = {
        HolderRecord.from_json(kv.value).instance_id: HolderRecord.from_json(kv.value)
        for kv in await etcd_client.get_prefix(wkeys.holders(JOB, 1))
    }
    assert holders["trainer"].role == ROLE_TRAINER and holders["puller"].role == ROLE_RELAY


async def test_a_pull_of_a_version_its_watch_has_listed_reads_and_parses_nothing_again(
    peers: Any,
) -> None:
    trainer, puller = await peers(("trainer",), ("puller", "--no-relay"))
    await trainer.call("publish", version=1, seed=4)
    await _sees(puller, 1, "trainer")
    # The watch parsed the manifest as it came, before any pull asked for it.
    assert (await puller.call("state"))["counters"]["manifests_parsed"] == 1
    result = await puller.call("pull", version=1)

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(4))
    assert _only_from(result["counters"], "trainer")
    assert result["counters"]["etcd_reads"] == 0
    # Pulls took the parsed one (parsing a manifest of 3,000 tensors took 6 ms).
    again = await puller.call("pull", version=1)
    assert again["ok"] and again["counters"]["manifests_parsed"] == 1


async def test_a_pull_whose_view_lacks_the_holder_record_yet_reads_etcd_instead_of_giving_up(
    peers: Any,
) -> None:
    # The watch can deliver a manifest a moment before its publisher's holder record. With a
    # newer version about, a pull that trusted that listing took its version for stranded.
    trainer, puller = await peers(("trainer", "--keep", "3"), ("puller", "--no-relay"))
    for version in (1, 2):
        await trainer.call("publish", version=version, seed=version)
    await _sees(puller, 2, "trainer")
    lagging = await puller.call("lag", version=1, holder="trainer")
    assert lagging["listed"]["1"] == []

    result = await puller.call("pull", version=1)

    assert result["ok"], result
    assert result["digest"] == tensors_digest(make_tensors(1))
    assert _only_from(result["counters"], "trainer")
    assert result["counters"]["etcd_reads"] == 1


async def _pullers_in_record(client: Any, settings: EtcdSettings, holder: str) -> int:
    key = WeightKeys(KeySpace(settings.prefix)).holder(JOB, 1, holder)
    return HolderRecord.from_json((await client.get(key)).value).active_pullers


async def test_a_pull_shorter_than_the_record_delay_writes_no_holder_record(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    delay = 2.0
    trainer, puller = await peers(
        ("trainer", "--record-delay", str(delay)), ("puller", "--no-relay")
    )
    await trainer.call("publish", version=1, seed=4)
    before = (await trainer.call("state"))["counters"]
    written = before["records_written"]
    assert written == 1  # the publish registers the trainer as a holder at once
    await _sees(puller, 1, "trainer")

    result = await puller.call("pull", version=1)

    async def looked_again() -> bool:
        # The look the pull's start scheduled, delay later: any write it makes comes before.
        counters = (await trainer.call("state"))["counters"]
        return bool(counters["pullers_checks"] > before["pullers_checks"])

    await eventually(looked_again, timeout=delay + 30)

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(4))
    # The count went 0 -> 1 -> 0 within the delay: the record still says 0, with no write.
    assert (await trainer.call("state"))["counters"]["records_written"] == written
    assert await _pullers_in_record(etcd_client, etcd_settings, "trainer") == 0


async def test_a_holder_records_a_pull_that_outlasts_the_record_delay(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    trainer, puller = await peers(
        ("trainer", "--stall-after", "2", "--record-delay", "0.2"),
        ("puller", "--no-relay", "--stall-timeout", "60"),
    )
    await trainer.call("publish", version=1, seed=4)
    await _sees(puller, 1, "trainer")

    puller.send("pull", version=1)  # the trainer stalls after 2 buckets
    await trainer.call("wait_served", buckets=2)

    async def counted() -> bool:
        return await _pullers_in_record(etcd_client, etcd_settings, "trainer") == 1

    await eventually(counted, timeout=10)
    assert (await trainer.call("state"))["counters"]["records_written"] == 2
    puller.kill()  # the pull would wait out its timeout; its outcome is not the point here
    await puller.proc.wait()


async def test_a_holder_that_fills_up_says_so_in_its_record_without_the_delay(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    # Pullers skip a full holder by its record, so filling up is written at once.
    trainer, puller = await peers(
        ("trainer", "--max-pullers", "1", "--stall-after", "2", "--record-delay", "600"),
        ("puller", "--no-relay", "--stall-timeout", "60"),
    )
    await trainer.call("publish", version=1, seed=4)
    await _sees(puller, 1, "trainer")

    puller.send("pull", version=1)  # the trainer stalls after 2 buckets, its one slot taken

    async def full() -> bool:
        return await _pullers_in_record(etcd_client, etcd_settings, "trainer") == 1

    await eventually(full, timeout=10)
    puller.kill()
    await puller.proc.wait()


async def test_a_slot_freed_while_the_full_record_is_written_is_recorded_at_once(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    # A pull shorter than an etcd write: the holder frees its one slot while the write that
    # says it is full is under way. Pullers skip a holder whose record says full, so the
    # freed slot must be written at once, not a record delay (here 600 s) later.
    trainer, puller = await peers(
        ("trainer", "--max-pullers", "1", "--record-delay", "600"), ("puller", "--no-relay")
    )
    await trainer.call("publish", version=1, seed=4)
    await _sees(puller, 1, "trainer")
    await trainer.call("gate_txns")

    assert (await puller.call("pull", version=1))["ok"]  # taken and freed; the write waits
    await trainer.call("ungate_txns")  # the write says full, of a holder free again

    async def written(count: int) -> bool:
        return (await trainer.call("state"))["counters"]["records_written"] >= count

    await eventually(functools.partial(written, 2), timeout=10)  # the publish's, then "full"
    await eventually(functools.partial(written, 3), timeout=10)  # then "free", at once
    assert await _pullers_in_record(etcd_client, etcd_settings, "trainer") == 0


async def test_a_relay_serves_the_next_puller_instead_of_the_trainer(peers: Any) -> None:
    trainer, relay, late = await peers(("trainer",), ("relay",), ("late",))
    await trainer.call("publish", version=1, seed=5)
    assert _only_from((await relay.call("pull", version=1))["counters"], "trainer")
    await _sees(late, 1, "relay")

    result = await late.call("pull", version=1)

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(5))
    assert _only_from(result["counters"], "relay")
    served = (await trainer.call("state"))["counters"]["buckets_served"]
    assert served == N_BUCKETS  # only the relay's pull touched the trainer


# What moving weights costs in CPU time (idle trainers and pullers, a holder waiting for a parked
# puller, a trainer serving pulls) is measured by benchmarks/idle_cpu.py, with the bounds these
# tests once asserted (docs/decisions/0114); the outcomes of the same runs are asserted here.


async def test_a_puller_gives_its_endpoint_back_once_idle(peers: Any) -> None:
    """After a pull, the puller's endpoint stays parked park_seconds and then goes: the holder
    serves no endpoint while the job is idle."""
    trainer, puller = await peers(("trainer",), ("puller",))
    await trainer.call("publish", version=1, seed=4)
    assert (await puller.call("pull", version=1))["ok"]

    async def unparked() -> bool:
        return (await trainer.call("state"))["serving"] == 0

    await eventually(unparked, timeout=10)


async def test_a_parked_endpoint_stays_open_and_serves_the_next_pull(peers: Any) -> None:
    """A holder keeps serving the endpoint a puller parked, however long the puller waits
    before its next request; that request comes over the same endpoint."""
    trainer, puller = await peers(("trainer",), ("puller", "--park-seconds", "60"))
    await trainer.call("publish", version=1, seed=4)
    assert (await puller.call("pull", version=1))["ok"]

    assert (await trainer.call("state"))["serving"] == 1
    await asyncio.sleep(2.0)  # the idle spell the endpoint stays parked through, not a wait
    assert (await trainer.call("state"))["serving"] == 1  # parked all along

    # And it still answers: the next pull is served over the kept endpoint.
    await trainer.call("publish", version=2, seed=5)
    result = await puller.call("pull", version=2)
    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(5))
    assert result["counters"]["endpoints_opened"] == 1


async def test_a_warm_puller_pulls_a_large_version_whole_from_the_trainer_again_and_again(
    peers: Any,
) -> None:
    """Nine pulls of 256 MiB in 32 MiB buckets over one kept endpoint and buffer: every one
    verified, every byte of them served by the trainer."""
    big = ("--bucket-bytes", str(32 << 20))
    trainer, puller = await peers(("trainer", *big), ("puller", *big, "--no-relay"))
    await trainer.call("publish", version=1, seed=4, bulk_mib=256)
    assert (await puller.call("pull", version=1))["ok"]  # endpoint and buffer warm

    published = tensors_digest(make_tensors(4, 256))
    for _ in range(8):
        pulled = await puller.call("pull", version=1)
        assert pulled["ok"] and pulled["digest"] == published

    counters = (await trainer.call("state"))["counters"]
    assert counters["bytes_served"] >= 9 * (256 << 20)  # every pull came from the trainer


async def test_a_puller_that_pulls_every_second_keeps_its_endpoint(peers: Any) -> None:
    """An endpoint is closed park_seconds (2 s) after its latest park, not its first: pulls
    0.8 s apart over 2.4 s reuse one endpoint (before, the first park's timer closed it)."""
    trainer, puller = await peers(("trainer",), ("puller",))
    for version in range(1, 5):
        await trainer.call("publish", version=version, seed=version)
        assert (await puller.call("pull", version=version))["ok"]
        if version < 4:
            await asyncio.sleep(0.8)  # the spacing under test, not a wait for a condition

    counters = (await puller.call("state"))["counters"]
    assert counters["pulls_completed"] == 4
    assert counters["endpoints_opened"] == 1


async def test_a_process_holding_the_tensors_relays_them_and_wrong_ones_are_refused(
    peers: Any,
) -> None:
    trainer, holder, puller = await peers(("trainer",), ("holder",), ("puller",))
    await trainer.call("publish", version=1, seed=5)

    wrong = await holder.call("hold", version=1, seed=6)
    right = await holder.call("hold", version=1, seed=5)
    assert right["ok"], right
    await _sees(puller, 1, "holder")
    result = await puller.call("pull", version=1)

    assert not wrong["ok"] and "do not match the manifest" in wrong["error"]
    assert right["ok"]
    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(5))
    assert _only_from(result["counters"], "holder")


async def test_a_source_killed_mid_pull_is_replaced_and_verified_buckets_kept(
    peers: Any,
) -> None:
    trainer, relay, puller = await peers(
        ("trainer",), ("relay", "--stall-after", "2"), ("puller", "--progress-every", "0")
    )
    await trainer.call("publish", version=1, seed=7)
    await relay.call("pull", version=1)
    await _sees(puller, 1, "relay")

    pulling = puller.send("pull", version=1)  # prefers the relay; it stalls after 2 buckets
    await relay.call("wait_served", buckets=2)
    relay.kill()  # SIGKILL mid-pull
    result = await puller.reply(pulling, timeout=60)

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(7))
    counters = result["counters"]
    assert counters["buckets_by_source"] == {"relay": 2, "trainer": N_BUCKETS - 2}
    assert counters["source_failures"] == 1 and counters["source_switches"] == 1
    # Its progress, logged at every bucket here, shows where each bucket came from.
    progress = _logged(puller, "weights.pull_progress")
    assert [line["source"] for line in progress] == ["relay"] * 2 + ["trainer"] * (N_BUCKETS - 2)
    received = [int(line["received_bytes"]) for line in progress]
    assert received == sorted(received) and received[-1] == int(progress[-1]["total_bytes"])
    assert progress[-1]["percent"] == "100.0"


async def test_a_pull_whose_only_holder_died_stops_once_a_newer_epoch_publishes(
    peers: Any,
) -> None:
    old, puller = await peers(
        ("trainer-old", "--stall-after", "2"), ("puller", "--pull-timeout", "60")
    )
    await old.call("publish", version=3, seed=3)
    pulling = puller.send("pull", version=3)
    await old.call("wait_served", buckets=2)
    old.kill()  # the only holder of version 3 dies mid-pull
    (new,) = await peers(("trainer-new", "--epoch", "2"))
    began = time.monotonic()
    await new.call("publish", version=3, seed=4)  # restored: the same version, a new epoch
    result = await puller.reply(pulling, timeout=60)
    waited = time.monotonic() - began

    assert not result["ok"] and "given up because its manifest was replaced" in result["error"]
    assert waited < 10, f"the pull waited {waited:.1f}s for a holder that was gone"
    fresh = await puller.call("pull", version=3)
    assert fresh["ok"] and fresh["digest"] == tensors_digest(make_tensors(4))


async def test_a_relay_keeps_a_version_a_restored_trainer_publishes_again_bit_for_bit(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    old, relay, late = await peers(("trainer-old", "--epoch", "1"), ("relay",), ("late",))
    await old.call("publish", version=3, seed=5)
    assert (await relay.call("pull", version=3))["ok"]
    old.kill()  # the trainer fails; its standby restores the checkpoint of step 3
    await old.proc.wait()
    (new,) = await peers(("trainer-new", "--epoch", "2"))
    await new.call("publish", version=3, seed=5)
    record_key = WeightKeys(KeySpace(etcd_settings.prefix)).holder(JOB, 3, "relay")

    async def record_says(epoch: int | None) -> bool:
        got = await etcd_client.get(record_key)
        return (None if got is None else HolderRecord.from_json(got.value).trainer_epoch) == epoch

    await eventually(lambda: record_says(2), timeout=10)
    state = await relay.call("state")
    assert 3 in state["held"] and state["counters"]["versions_kept"] == 1
    await _sees(late, 3, "relay")
    result = await late.call("pull", version=3)
    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(5))
    assert _only_from(result["counters"], "relay")  # not from the new trainer

    # Published again with other bytes: the copy goes, and its record with it.
    (newer,) = await peers(("trainer-newer", "--epoch", "3"))
    await newer.call("publish", version=3, seed=6)
    await eventually(lambda: record_says(None), timeout=10)
    state = await relay.call("state")
    assert 3 not in state["held"] and state["counters"]["versions_kept"] == 1


async def test_an_announcement_ahead_of_the_watch_gets_a_held_copy_only_if_the_bytes_match(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """A rollout can read the announcement of a restored trainer's version before its own
    watch delivers the manifest written with it; the copy it holds of the older epoch must
    then be checked against that manifest, not returned as it is."""
    keys = KeySpace(etcd_settings.prefix)
    old = UcxTransport(etcd_client, keys, JOB, instance_id="t-old", epoch=1)
    new = UcxTransport(etcd_client, keys, JOB, instance_id="t-new", epoch=2)
    relay = UcxTransport(etcd_client, keys, JOB, instance_id="relay", pull_timeout=3)
    for transport in (old, new, relay):
        await transport.start()
    try:
        await old.publish(3, make_tensors(5))
        await relay.hold(3, make_tensors(5))
        # The watch: stopped, it stays behind every write from now on.
        (watch,) = [t for t in relay.lifetime.tasks if t.get_name().startswith("ucx-weights-gc-")]
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await new.publish(3, make_tensors(5))  # the same bytes under epoch 2

        same = await relay.fetch(Announcement(JOB, 3, new.address, 2, relay.name))
        assert tensors_digest(same) == tensors_digest(make_tensors(5))
        assert relay.counters.versions_kept == 1 and relay.counters.pulls_completed == 0

        newer = UcxTransport(etcd_client, keys, JOB, instance_id="t-newer", epoch=3)
        await newer.start()
        try:
            await newer.publish(3, make_tensors(6))  # other bytes under epoch 3
            other = await relay.fetch(Announcement(JOB, 3, newer.address, 3, relay.name))
            assert tensors_digest(other) == tensors_digest(make_tensors(6))
            assert relay.counters.pulls_completed == 1
        finally:
            await newer.close()
    finally:
        for transport in (relay, new, old):
            await transport.close()


async def test_a_pull_that_ends_after_its_manifest_was_written_again_keeps_the_same_bytes(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """The demo's trainer failover: a rollout pulling the failed trainer's last version
    finishes it from the standby (same digest) after the standby published it again. Its
    holder record, fenced by the manifest revision it read, cannot be written; the copy is
    checked against the new manifest and kept, and the record written under it."""
    keys = KeySpace(etcd_settings.prefix)
    old = UcxTransport(etcd_client, keys, JOB, instance_id="t-old", epoch=1)
    new = UcxTransport(etcd_client, keys, JOB, instance_id="t-new", epoch=2)
    relay = UcxTransport(etcd_client, keys, JOB, instance_id="relay")
    for transport in (old, new, relay):
        await transport.start()
    try:
        await old.publish(3, make_tensors(5))
        await eventually(lambda: _listed(relay, 3, "t-old"), timeout=10)
        # The relay's watch stopped: the pull below reads the old manifest from its view.
        (watch,) = [t for t in relay.lifetime.tasks if t.get_name().startswith("ucx-weights-gc-")]
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await new.publish(3, make_tensors(5))

        pulled = await relay.pull(JOB, 3)
        assert tensors_digest(pulled) == tensors_digest(make_tensors(5))
        record_key = WeightKeys(keys).holder(JOB, 3, "relay")

        async def recorded_under_epoch_2() -> bool:
            got = await etcd_client.get(record_key)
            return got is not None and HolderRecord.from_json(got.value).trainer_epoch == 2

        await eventually(recorded_under_epoch_2, timeout=10)
        assert relay.held_versions() == [3] and relay.counters.versions_kept == 1
    finally:
        for transport in (relay, new, old):
            await transport.close()


@pytest.mark.parametrize("pull_thread", [True, False])
async def test_pulls_deliver_the_same_bytes_with_or_without_a_pulling_thread(
    etcd_client: Any, etcd_settings: EtcdSettings, pull_thread: bool
) -> None:
    """ROBUSTRL_UCX_PULL_THREAD's two settings: endpoints on the worker a thread of its own
    progresses, or on the process's worker (the one that serves); the same tensors either
    way, bit for bit."""
    keys = KeySpace(etcd_settings.prefix)
    trainer = UcxTransport(etcd_client, keys, JOB, instance_id="t", relay=False)
    puller = UcxTransport(etcd_client, keys, JOB, instance_id="p", pull_thread=pull_thread)
    for transport in (trainer, puller):
        await transport.start()
    try:
        await trainer.publish(1, make_tensors(3))
        pulled = await puller.pull(JOB, 1)
        assert tensors_digest(pulled) == tensors_digest(make_tensors(3))
        maker = puller.endpoints_for_pulls()
        assert getattr(maker, "progress_mode", "module") == ("thread" if pull_thread else "module")
    finally:
        for transport in (puller, trainer):
            await transport.close()


def test_pulls_use_the_pulling_thread_on_a_host_without_cuda_unless_turned_off(
    etcd_client: Any, etcd_settings: EtcdSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default, and ROBUSTRL_UCX_PULL_THREAD=0 (any other value leaves it on). A CUDA
    host pulls on the process's worker whatever the setting."""
    on = not torch.cuda.is_available()
    keys = KeySpace(etcd_settings.prefix)
    for value, expected in ((None, on), ("0", False), ("1", on)):
        if value is None:
            monkeypatch.delenv("ROBUSTRL_UCX_PULL_THREAD", raising=False)
        else:
            monkeypatch.setenv("ROBUSTRL_UCX_PULL_THREAD", value)
        assert UcxTransport(etcd_client, keys, JOB, instance_id="p").pull_thread is expected


def test_a_request_names_its_buckets_as_ranges() -> None:
    assert bucket_ranges([]) == []
    assert bucket_ranges(range(5000)) == [[0, 5000]]
    assert bucket_ranges([0, 1, 2, 5, 7, 8]) == [[0, 3], [5, 6], [7, 9]]


async def test_a_version_of_thousands_of_buckets_moves_in_one_request(peers: Any) -> None:
    """A version of 8,600 buckets (256 bytes each): its reply used to list every bucket's size
    and outgrew the 64 KiB control limit from about 4,000 buckets (a 70B model in 32 MiB
    buckets); the pull failed as a protocol mismatch."""
    small = ("--bucket-bytes", "256")
    trainer, puller = await peers(("trainer", *small), ("puller", *small, "--no-relay"))
    await trainer.call("publish", version=1, seed=8)

    result = await puller.call("pull", version=1, timeout=60)

    assert result["ok"], result
    assert result["digest"] == tensors_digest(make_tensors(8))
    buckets = result["counters"]["buckets_by_source"]["trainer"]
    assert buckets == len(plan_layout(make_tensors(8), 256)[2]) > 8000
    assert result["counters"]["source_failures"] == 0


async def test_a_request_that_is_not_one_gets_a_clear_error_and_changes_nothing(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """Malformed requests are refused with a code saying why; a message that is not a
    request of this protocol (ucxx's send_obj, as an older release sends) closes the endpoint.
    Either way the holder serves the next puller as before."""
    keys = KeySpace(etcd_settings.prefix)
    holder = UcxTransport(etcd_client, keys, JOB, instance_id="h", bucket_bytes=256 << 10)
    puller = UcxTransport(etcd_client, keys, JOB, instance_id="p", relay=False)
    for transport in (holder, puller):
        await transport.start()
    try:
        await holder.publish(1, make_tensors(5))
        held = holder.held.get(1)
        assert held is not None
        digest = held.manifest.digest
        conn = await HolderConnection.open(puller.endpoints_for_pulls(), holder.address, 5.0)
        base = {"op": "pull", "protocol": PROTOCOL_VERSION, "seq": 1, "job_id": JOB}
        bad = [
            ({**base, "version": "1"}, "bad_request"),
            ({**base, "version": 1, "buckets": [0, 1]}, "bad_request"),
            ({**base, "version": 1, "buckets": [[2, 1]]}, "bad_request"),
            ({**base, "version": 1, "buckets": [[0, True]]}, "bad_request"),
            ({**base, "version": 1, "buckets": [[0, N_BUCKETS + 1]]}, "no_such_bucket"),
            ({**base, "version": 1, "digest": "0" * 64, "buckets": [[0, 1]]}, "digest_mismatch"),
            ({**base, "protocol": 1, "version": 1, "buckets": [[0, 1]]}, "bad_request"),
        ]
        for body, code in bad:
            await ucx_progress.send_message(conn._ep, json.dumps(body).encode())
            reply = json.loads(await ucx_progress.receive_message(conn._ep, 1 << 16))
            assert (reply["status"], reply["code"]) == ("error", code), body
        # The same endpoint still serves a good request.
        seq, sizes = await conn.request(JOB, 1, digest, [0, 1])
        assert sizes == [(0, 256 << 10), (1, 256 << 10)]
        for index, nbytes in sizes:
            await conn.receive(torch.zeros(nbytes, dtype=torch.uint8), seq, index)
        await conn.close()

        legacy = await HolderConnection.open(puller.endpoints_for_pulls(), holder.address, 5.0)
        # send_obj's second message may fail: the holder hangs up after its first.
        with contextlib.suppress(Exception):
            await legacy._ep.send_obj(json.dumps({**base, "version": 1}).encode())

        async def refused_and_closed() -> bool:
            return holder.counters.requests_refused == len(bad) + 1 and not holder.server.endpoints

        await eventually(refused_and_closed, timeout=10)
        await legacy.close()
        pulled = await puller.pull(JOB, 1)
        assert tensors_digest(pulled) == tensors_digest(make_tensors(5))

        async def all_served() -> bool:  # a send is counted once the holder sees it done
            return holder.counters.buckets_served == 2 + N_BUCKETS

        await eventually(all_served, timeout=10)
    finally:
        for transport in (puller, holder):
            await transport.close()


@contextlib.asynccontextmanager
async def _connection_to(settings: EtcdSettings, client: Any, serve: Any) -> AsyncIterator[Any]:
    """A puller's HolderConnection to a bare ucxx listener that `serve`s each endpoint (a
    holder speaking whatever the test needs)."""
    puller = UcxTransport(client, KeySpace(settings.prefix), JOB, instance_id="p")
    await puller.start()
    slot = ucx_listeners.borrow(puller._ucxx, serve)
    try:
        address = f"127.0.0.1:{slot.port}"
        conn = await HolderConnection.open(puller.endpoints_for_pulls(), address, 5.0)
        try:
            yield conn
        finally:
            await conn.close()
    finally:
        ucx_listeners.give_back(slot)
        await puller.close()


async def test_control_messages_of_any_length_up_to_the_limit_arrive_whole(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """One UCX message while a body fits in FRAME_BYTES with its header, two beyond; both
    ways (the pulling thread's worker sending, the mended worker receiving, and back)."""
    too_long: list[Exception] = []

    async def echo(endpoint: Any) -> None:
        while True:
            try:
                body = await ucx_progress.receive_message(endpoint, 1 << 16)
            except FrameError as exc:
                too_long.append(exc)
                endpoint.abort()  # out of step, as a holder leaves it (its rest is unread)
                return
            await ucx_progress.send_message(endpoint, body)

    room = FRAME_BYTES - 8
    async with _connection_to(etcd_settings, etcd_client, echo) as conn:
        for length in (0, 1, room - 1, room, room + 1, 3 * room, 1 << 16):
            body = random.Random(length).randbytes(length)
            await ucx_progress.send_message(conn._ep, body)
            assert await ucx_progress.receive_message(conn._ep, 1 << 16) == body, length
        # Its second message fails: the receiver hangs up after the first.
        with contextlib.suppress(Exception):
            await ucx_progress.send_message(conn._ep, b"x" * ((1 << 16) + 1))
        assert len(too_long) == 1 and "at most 65536" in str(too_long[0])


async def test_a_reply_of_another_protocol_refuses_that_holder_and_nothing_else(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """A holder answering as the release before did (ucxx's send_obj, the length first) is a
    refusal (`bad_reply`), which a pull answers by trying another holder; it used to fail the
    whole pull as a WeightIntegrityError."""
    answered: list[bytes] = []

    async def old_holder(endpoint: Any) -> None:
        answered.append(await ucx_progress.receive_message(endpoint, 1 << 16))
        reply = {"status": "ok", "seq": 1, "buckets": [[0, 256]]}
        await endpoint.send_obj(json.dumps(reply).encode())

    async with _connection_to(etcd_settings, etcd_client, old_holder) as conn:
        with pytest.raises(HolderRefused) as refused:
            await conn.request(JOB, 1, "", [0])
    assert refused.value.code == "bad_reply" and "protocol mismatch" in refused.value.message
    assert json.loads(answered[0])["buckets"] == [[0, 1]]


@pytest.mark.parametrize("pull_thread", [True, False])
async def test_a_call_on_an_endpoint_aborted_under_it_fails_as_a_reset_connection(
    etcd_client: Any, etcd_settings: EtcdSettings, pull_thread: bool
) -> None:
    """A SourceGuard may abort a puller's endpoint while a request is under way; ucxx then
    raised AttributeError, which no pull handles (it crashed a rollout in the demo). It must
    fail as a reset connection, a source failure the pull recovers from."""
    keys = KeySpace(etcd_settings.prefix)
    holder = UcxTransport(etcd_client, keys, JOB, instance_id="h")
    puller = UcxTransport(etcd_client, keys, JOB, instance_id="p", pull_thread=pull_thread)
    for transport in (holder, puller):
        await transport.start()
    try:
        conn = await HolderConnection.open(puller.endpoints_for_pulls(), holder.address, 5.0)
        await conn.close()
        with pytest.raises(ConnectionResetError, match="aborted"):
            await conn.request(JOB, 1, "", [0])
        with pytest.raises(ConnectionResetError, match="aborted"):
            await conn.receive(torch.zeros(8, dtype=torch.uint8), 1, 0)
    finally:
        for transport in (puller, holder):
            await transport.close()


_SENTINEL = b"\xa5" * 16


def _sentinels() -> list[bytearray]:
    """Many 16-byte buffers, made right after a handshake buffer would have been freed: one
    of them takes its memory, and a stale write from UCX changes it."""
    gc.collect()
    return [bytearray(_SENTINEL) for _ in range(200_000)]


@pytest.mark.parametrize("pull_thread", [True, False])
async def test_a_connect_that_timed_out_on_a_frozen_holder_writes_into_no_freed_memory(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings, pull_thread: bool
) -> None:
    """ucxx's handshake posts a receive of the holder's 16 bytes and, when the holder is
    frozen and the connect times out, freed its buffer with the receive still posted: once
    the holder resumed, its bytes landed in memory Python had handed out again (a rollout of
    a demo run died of it). The buffer must be kept until that receive completes."""
    (holder,) = await peers(("holder",))
    puller = UcxTransport(
        etcd_client, KeySpace(etcd_settings.prefix), JOB, instance_id="p", pull_thread=pull_thread
    )
    await puller.start()
    try:
        maker = puller.endpoints_for_pulls()
        await (await HolderConnection.open(maker, holder.address, 5.0)).close()
        with stopped(holder.proc.pid):
            with pytest.raises(TimeoutError):
                await HolderConnection.open(maker, holder.address, 0.5)
            assert ucx_progress.pending_handshakes() == 1  # the receive UCX still holds
            sentinels = _sentinels()

        async def landed() -> bool:
            return ucx_progress.pending_handshakes() == 0

        await eventually(landed, timeout=20)  # the resumed holder's bytes, in the kept buffer
        assert [bytes(b).hex() for b in sentinels if b != _SENTINEL] == []
    finally:
        await puller.close()


_LATE_HANDSHAKE = """
import asyncio, sys
from robustrl.weights.ucx.transport import load_ucxx
from ucxx._lib_async import application_context

async def main(host, port, delay):
    ucxx = load_ucxx()
    exchange = application_context.exchange_peer_info

    async def late(*args, **kwargs):
        await asyncio.sleep(delay)  # as if frozen between connecting and answering
        return await exchange(*args, **kwargs)

    application_context.exchange_peer_info = late
    print("connecting", flush=True)
    try:
        await ucxx.create_endpoint(host, port, connect_timeout=30)
        print("connected", flush=True)
    except Exception as exc:
        print("failed", repr(exc), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


async def test_a_puller_frozen_in_its_handshake_writes_into_no_freed_memory_of_the_holder(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """The same on the listening side: a holder (a trainer) whose handshake with a frozen
    puller timed out had freed the buffer of a receive still posted, and the puller's bytes
    landed in the holder's memory once it went on. The puller here is a real process that
    answers 7 s late, past the listener's 5 s."""
    holder = UcxTransport(etcd_client, KeySpace(etcd_settings.prefix), JOB, instance_id="h")
    await holder.start()
    failed_before = ucx_progress.failed_handshakes
    host, port = holder.address.rsplit(":", 1)
    puller = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LATE_HANDSHAKE,
        host,
        port,
        "7",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert puller.stdout is not None
        assert await asyncio.wait_for(puller.stdout.readline(), 30) == b"connecting\n"

        async def gave_up() -> bool:
            return ucx_progress.failed_handshakes > failed_before

        await eventually(gave_up, timeout=20)
        assert ucx_progress.pending_handshakes() == 1  # the receive UCX still holds
        sentinels = _sentinels()
        answer = await asyncio.wait_for(puller.stdout.readline(), 30)
        assert answer == b"connected\n", answer

        async def landed() -> bool:
            return ucx_progress.pending_handshakes() == 0

        await eventually(landed, timeout=20)  # the puller's bytes, in the kept buffer
        assert [bytes(b).hex() for b in sentinels if b != _SENTINEL] == []
    finally:
        if puller.returncode is None:
            puller.kill()
        await puller.wait()
        await holder.close()


async def _listed(transport: UcxTransport, version: int, holder: str) -> bool:
    return holder in transport.listed_versions().get(version, [])


async def test_a_hung_source_is_abandoned_after_the_stall_timeout(peers: Any) -> None:
    trainer, relay, puller = await peers(
        ("trainer",), ("relay", "--stall-after", "2"), ("puller", "--stall-timeout", "2")
    )
    await trainer.call("publish", version=1, seed=8)
    await relay.call("pull", version=1)
    await _sees(puller, 1, "relay")

    result = await puller.call("pull", version=1)  # the relay stays alive but sends nothing

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(8))
    counters = result["counters"]
    assert counters["buckets_by_source"] == {"relay": 2, "trainer": N_BUCKETS - 2}
    assert counters["source_failures"] == 1


async def test_a_stopped_source_is_left_once_its_holder_record_goes(peers: Any) -> None:
    # The stall timeout is a minute: only the record's deletion can end this pull sooner.
    trainer, relay, puller = await peers(
        ("trainer",), ("relay", "--stall-after", "2"), ("puller", "--stall-timeout", "60")
    )
    await trainer.call("publish", version=1, seed=9)
    await relay.call("pull", version=1)
    await _sees(puller, 1, "relay")

    pulling = puller.send("pull", version=1)  # prefers the relay; it stalls after 2 buckets
    await relay.call("wait_served", buckets=2)
    stop_process(relay.proc.pid)  # frozen: its socket and endpoint stay open
    try:
        began = time.monotonic()
        result = await puller.reply(pulling, timeout=60)
        waited = time.monotonic() - began
    finally:
        relay.kill()  # SIGKILL ends a stopped process too

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(9))
    counters = result["counters"]
    assert counters["buckets_by_source"] == {"relay": 2, "trainer": N_BUCKETS - 2}
    assert counters["source_failures"] == 1
    # The relay's lease (2 s TTL) expires, etcd deletes its record, the puller moves on.
    assert waited < 10, f"the pull waited {waited:.1f}s on a stopped source"


async def test_a_connect_to_a_frozen_source_is_left_once_its_holder_record_goes(
    peers: Any,
) -> None:
    """A holder that froze (or died) before the pull connected: the connect's handshake would
    wait out its timeout (a minute here), but the pull moves on once the holder's record is
    deleted (here its 2 s lease expires; a fence withdraws a dead trainer's at once)."""
    trainer, relay, puller = await peers(
        ("trainer",), ("relay",), ("puller", "--connect-timeout", "60", "--stall-timeout", "60")
    )
    await trainer.call("publish", version=1, seed=12)
    await relay.call("pull", version=1)
    await _sees(puller, 1, "relay")
    stop_process(relay.proc.pid)  # frozen before the puller ever connected to it
    try:
        began = time.monotonic()
        result = await puller.call("pull", version=1, timeout=60)  # prefers the relay
        waited = time.monotonic() - began
    finally:
        relay.kill()

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(12))
    counters = result["counters"]
    assert counters["buckets_by_source"] == {"trainer": N_BUCKETS}
    assert counters["source_failures"] == 1
    assert waited < 10, f"the pull waited {waited:.1f}s on a connect to a frozen source"


async def test_fencing_withdraws_only_the_fenced_instances_holder_records(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    trainer, relay, puller = await peers(
        ("trainer",), ("relay", "--stall-after", "2"), ("puller", "--stall-timeout", "60")
    )
    await trainer.call("publish", version=1, seed=10)
    await trainer.call("publish", version=2, seed=11)
    await relay.call("pull", version=1)
    await relay.call("pull", version=2)
    await _sees(puller, 2, "relay")
    keys = KeySpace(etcd_settings.prefix)

    pulling = puller.send("pull", version=2)
    await relay.call("wait_served", buckets=2)
    stop_process(relay.proc.pid)
    try:
        began = time.monotonic()
        withdrawn = await withdraw_holder_records(etcd_client, keys, JOB, "relay")
        result = await puller.reply(pulling, timeout=60)
        waited = time.monotonic() - began
    finally:
        relay.kill()

    assert withdrawn == 2  # versions 1 and 2
    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(11))
    assert result["counters"]["buckets_by_source"] == {"relay": 2, "trainer": N_BUCKETS - 2}
    # Well inside the relay's own 2 s lease: the withdrawal, not the expiry, moved the pull.
    assert waited < 1.5, f"the pull took {waited:.1f}s to leave a withdrawn source"
    wkeys = WeightKeys(keys)
    holders = {
        version: sorted(
            kv.key.rsplit(b"/", 1)[1].decode()
            for kv in await etcd_client.get_prefix(wkeys.holders(JOB, version))
        )
        for version in (1, 2)
    }
    assert holders == {1: ["trainer"], 2: ["puller", "trainer"]}


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
async def test_a_corrupt_bucket_is_never_used_and_is_pulled_again_elsewhere(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings, algorithm: str
) -> None:
    trainer, relay, puller = await peers(
        ("trainer", "--checksum", algorithm), ("relay", "--corrupt", "1"), ("puller",)
    )
    await trainer.call("publish", version=1, seed=9)
    await relay.call("pull", version=1)
    await _sees(puller, 1, "relay")

    result = await puller.call("pull", version=1)

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(9))
    counters = result["counters"]
    assert counters["checksum_failures"] == 1
    assert counters["buckets_by_source"] == {"relay": N_BUCKETS - 1, "trainer": 1}
    assert (await _manifest(etcd_client, etcd_settings, 1)).checksum_algorithm == algorithm


async def test_a_late_joiner_gets_the_current_version_from_a_relay_with_the_trainer_gone(
    peers: Any,
) -> None:
    # The joiner's process starts with the others only to save start-up time: it first looks
    # at etcd, and pulls, after the trainer is gone.
    trainer, relay, joiner = await peers(("trainer",), ("relay",), ("joiner",))
    await trainer.call("publish", version=1, seed=1)
    await trainer.call("publish", version=2, seed=2)
    assert (await relay.call("fetch_latest"))["ok"]
    await _sees(joiner, 2, "relay")
    trainer.kill()
    await trainer.proc.wait()

    result = await joiner.call("fetch_latest")

    assert result["ok"] and result["digest"] == tensors_digest(make_tensors(2))
    assert _only_from(result["counters"], "relay")


async def test_tensors_a_caller_keeps_stay_intact_while_later_versions_are_pulled(
    peers: Any,
) -> None:
    # The puller relays (holds the newest version) and reuses receive buffers nobody uses.
    trainer, puller = await peers(("trainer",), ("puller", "--keep", "1"))
    for version in (1, 2, 3, 4):
        await trainer.call("publish", version=version, seed=version)
        result = await puller.call("pull", version=version, keep=version == 1)
        assert result["ok"] and result["digest"] == tensors_digest(make_tensors(version))

    kept = await puller.call("kept")

    assert kept["digests"] == {"1": tensors_digest(make_tensors(1))}


async def test_a_relay_that_keeps_one_version_stages_one_model_copy(peers: Any) -> None:
    # A rollout's settings: it relays the newest version, and receives the next one into the
    # same buffer instead of a second one.
    trainer, relay, late = await peers(("trainer",), ("relay", "--keep", "1"), ("late",))
    resident = []
    for version in (1, 2, 3):
        await trainer.call("publish", version=version, seed=version, bulk_mib=64)
        result = await relay.call("pull", version=version)
        assert result["ok"] and result["digest"] == tensors_digest(make_tensors(version, 64))
        resident.append(resident_bytes(relay.proc.pid))

    grown = resident[-1] - resident[0]
    assert grown < 16 << 20, f"the relay grew by {grown >> 20} MiB after its first pull"
    assert (await relay.call("state"))["held"] == [3]
    await _sees(late, 3, "relay")
    served = await late.call("pull", version=3)
    assert served["ok"] and served["counters"]["bytes_by_source"].get("relay", 0) > 64 << 20


def resident_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for pid {pid}")


async def test_a_trainer_packing_into_a_dropped_versions_buffer_publishes_correct_bytes(
    peers: Any,
) -> None:
    # keep 1: publishing v2 drops v1, so v3 is packed into v1's buffer.
    trainer, holder, puller = await peers(("trainer", "--keep", "1"), ("holder",), ("puller",))
    for version in (1, 2, 3):
        assert (await trainer.call("publish", version=version, seed=version))["ok"]

    pulled = await puller.call("pull", version=3)
    # A fresh packing of the same tensors matches the trainer's checksums bucket for bucket.
    held = await holder.call("hold", version=3, seed=3)

    assert pulled["ok"] and pulled["digest"] == tensors_digest(make_tensors(3))
    assert _only_from(pulled["counters"], "trainer")
    assert held["ok"], held


async def test_a_holder_asked_for_what_it_does_not_hold_answers_with_a_clear_error(
    peers: Any,
) -> None:
    trainer, asker = await peers(("trainer",), ("asker",))
    await trainer.call("publish", version=1, seed=3)

    missing_version = await asker.call("ask", address=trainer.address, version=7)
    missing_bucket = await asker.call("ask", address=trainer.address, version=1, buckets=[999])
    present = await asker.call("ask", address=trainer.address, version=1, buckets=[0])
    no_manifest = await asker.call("pull", version=7)

    assert missing_version["code"] == "not_held"
    assert "holds versions [1]" in missing_version["message"]
    assert "not version 7" in missing_version["message"]
    assert missing_bucket["code"] == "no_such_bucket"
    assert present["ok"] and present["sizes"] == [[0, 256 << 10]]
    assert not no_manifest["ok"] and "no manifest for version 7" in no_manifest["error"]


async def test_a_closed_holder_refuses_connections_and_a_new_transport_serves_on_its_port(
    peers: Any,
) -> None:
    """ucxx frees a closed listener's callback data while the listener still takes
    connections (ucx_listeners): a puller that connected after the close made the holder
    read freed memory. Now the port outlives the transport, refuses, and is reused."""
    trainer, rollout = await peers(("trainer",), ("rollout", "--no-relay"))
    await trainer.call("publish", version=1, seed=3)
    assert (await rollout.call("pull", version=1))["ok"]  # the trainer accepted an endpoint
    old_address = trainer.address

    await trainer.call("close")
    refused = await rollout.call("ask", address=old_address, version=1)
    reopened = await trainer.call("reopen")
    await trainer.call("publish", version=2, seed=4)
    pulled = await rollout.call("pull", version=2)

    assert not refused["ok"] and refused["code"] == "failed", refused
    assert reopened["address"] == old_address
    assert pulled["ok"] and pulled["digest"] == tensors_digest(make_tensors(4))
    # The rollout's endpoint kept from the first pull died with the first transport: it
    # connects again instead of counting the trainer as failed.
    assert pulled["counters"]["kept_endpoints_lost"] == 1
    assert pulled["counters"]["source_failures"] == 0
    assert "when calling listener callback" not in trainer.log_path.read_text()


async def test_superseded_versions_leave_etcd_and_the_holders(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    trainer, relay = await peers(("trainer", "--keep", "2"), ("relay", "--keep", "2"))
    await trainer.call("publish", version=1, seed=1)
    await relay.call("pull", version=1)
    await trainer.call("publish", version=2, seed=2)
    await trainer.call("publish", version=3, seed=3)

    wkeys = WeightKeys(KeySpace(etcd_settings.prefix))
    assert not await etcd_client.get_prefix(wkeys.version(JOB, 1))
    assert await etcd_client.get(wkeys.manifest(JOB, 3)) is not None

    async def relay_dropped_v1() -> bool:
        return (await relay.call("state"))["held"] == []

    await eventually(relay_dropped_v1, timeout=10)
    assert (await trainer.call("state"))["held"] == [2, 3]


async def test_a_manifest_from_an_older_trainer_epoch_is_ignored(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    old, new, puller = await peers(
        ("trainer-old", "--epoch", "1"), ("trainer-new", "--epoch", "2"), ("puller",)
    )
    await old.call("publish", version=1, seed=1)
    await new.call("publish", version=2, seed=2)
    assert (await puller.call("fetch_latest"))["ok"]  # sees epoch 2

    zombie = await old.call("publish", version=3, seed=3)  # the fenced trainer publishes late
    assert not zombie["ok"] and zombie["error"].startswith("Fenced")
    # Even a manifest that reached etcd behind the guard is not pulled from the older epoch.
    wkeys = WeightKeys(KeySpace(etcd_settings.prefix))
    raw = (await etcd_client.get(wkeys.manifest(JOB, 2))).value
    stale = BucketManifest.from_json(raw)
    forged = BucketManifest(
        JOB, 4, 1, stale.total_bytes, stale.bucket_bytes, stale.tensors, stale.buckets
    )
    await etcd_client.put(wkeys.manifest(JOB, 4), forged.to_json())

    result = await puller.call("pull", version=4)
    latest = await puller.call("latest")

    assert not result["ok"] and "older than epoch 2" in result["error"]
    assert latest["version"] == 2


async def test_a_publish_whose_lease_lapsed_unnoticed_succeeds_and_registers_under_the_next(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """etcd was unreachable past the session's TTL: its lease is gone, and the keepalive has
    not noticed yet when the trainer publishes. The publish must not fail (once it did, and
    the job with it); the holder record comes under the next session."""
    wkeys = WeightKeys(KeySpace(etcd_settings.prefix))
    trainer = UcxTransport(
        etcd_client,
        KeySpace(etcd_settings.prefix),
        JOB,
        instance_id="t",
        epoch=1,
        session_ttl=30,  # keepalives 10 s apart: the lapse goes unnoticed for a while
    )
    await trainer.start()
    try:
        assert trainer.records.session is not None
        lapsed = trainer.records.session.lease_id
        await asyncio.sleep(0.5)  # past the session's first refresh; the next is 10 s away
        await etcd_client.revoke_lease(lapsed)
        await trainer.publish(1, make_tensors(0))
        holder = wkeys.holder(JOB, 1, "t")

        async def registered_again() -> bool:
            got = await etcd_client.get(holder)
            return got is not None and got.lease != lapsed

        await eventually(registered_again, timeout=30)
    finally:
        await trainer.close()


async def test_make_transport_falls_back_to_grpc_when_asked_or_when_ucx_cannot_start(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    keys = KeySpace(etcd_settings.prefix)
    asked = await make_transport(
        "grpc", etcd_client, keys, JOB, instance_id="r", grpc_address="x:1"
    )
    assert isinstance(asked, GrpcStreamTransport)
    with pytest.raises(ValueError):
        await make_transport("carrier-pigeon", etcd_client, keys, JOB, instance_id="r")

    # A host where UCX finds no usable transport (here: a bogus UCX_TLS) gets gRPC, not a crash.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.ucx_peer",
        "--endpoints",
        etcd_settings.endpoints,
        "--prefix",
        etcd_settings.prefix,
        "--instance",
        "probe",
        "--probe-transport",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "UCX_TLS": "no-such-transport"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().splitlines()[-1]) == {"event": "transport", "name": "grpc"}
    assert b"weights.ucx_unavailable" in err


def test_choose_holder_spreads_load_and_spares_the_trainer() -> None:
    def holder(name: str, role: str, active: int, cap: int = 0) -> HolderRecord:
        return HolderRecord(name, f"h:{len(name)}", role, 1, "d", active, cap)

    rng = random.Random(0)
    trainer = holder("trainer", ROLE_TRAINER, 0)
    busy_relay = holder("relay-a", ROLE_RELAY, 2)
    idle_relay = holder("relay-b", ROLE_RELAY, 0)
    assert choose_holder([trainer, busy_relay, idle_relay], rng) == idle_relay
    assert choose_holder([trainer, busy_relay], rng) == trainer
    assert choose_holder([holder("full", ROLE_RELAY, 1, cap=1)], rng) is None
    assert choose_holder([], rng) is None


def test_the_versions_view_follows_the_watch_and_answers_only_for_listed_manifests() -> None:
    wkeys = WeightKeys(KeySpace("/t"))

    def put(key: bytes, revision: int) -> Put:
        return Put(Entry(key, b"{}", revision, revision, 0))

    view = VersionsView(wkeys, JOB)
    assert view.version(1) is None  # not listed yet
    view.reset([put(wkeys.manifest(JOB, 1), 5).entry], 5)
    assert view.version(1) == ([put(wkeys.manifest(JOB, 1), 5).entry], 5)
    assert view.version(2) is None  # a version it has not seen goes to etcd

    view.apply(put(wkeys.holder(JOB, 1, "trainer"), 6))
    view.apply(put(wkeys.manifest(JOB, 2), 7))
    view.apply(put(wkeys.holder(JOB, 2, "relay"), 8))
    view.apply(Delete(wkeys.holder(JOB, 1, "trainer"), 9))
    assert view.versions() == {1: [], 2: ["relay"]}
    entries, revision = view.version(2) or ([], 0)
    assert revision == 9 and {e.key for e in entries} == {
        wkeys.manifest(JOB, 2),
        wkeys.holder(JOB, 2, "relay"),
    }

    view.apply(Resync([put(wkeys.manifest(JOB, 3), 20).entry], 20))
    assert view.versions() == {3: []} and view.version(2) is None


def test_a_receive_buffer_is_handed_out_again_only_once_no_tensor_uses_it() -> None:
    buffers = HostBuffers(keep=2)
    pulled = buffers.take(4096)
    kept = pulled[64:128].view(torch.float32)  # a caller still holds part of a pull
    kept.fill_(1.0)
    del pulled

    again = buffers.take(4096)
    again.fill_(0)

    assert torch.all(kept == 1.0)
    address = again.data_ptr()
    del again
    assert buffers.take(4096).data_ptr() == address


def test_packing_into_a_used_buffer_gives_the_bytes_of_a_fresh_one() -> None:
    tensors = make_tensors(0)
    entries, total, _ = plan_layout(tensors, 256 << 10)
    ends = [e.offset + e.nbytes for e in entries]
    assert any(e.offset > end for e, end in zip(entries[1:], ends, strict=False))  # gaps exist
    fresh = allocate_buffer(total)
    used = torch.full((total,), 0xFF, dtype=torch.uint8)  # what an earlier version left

    pack_into(tensors, entries, fresh)
    pack_into(tensors, entries, used)

    assert torch.equal(fresh, used)


def test_unpacked_tensors_are_contiguous_views_equal_to_the_packed_ones() -> None:
    tensors = [
        *make_tensors(2),
        ("odd.after_bool", torch.arange(5, dtype=torch.int16)),
        ("zero_dim_int", torch.tensor(7, dtype=torch.int32)),
    ]
    entries, total, spans = plan_layout(tensors, 256 << 10)
    buckets = tuple(BucketEntry(i, o, n, "0" * 32) for i, (o, n) in enumerate(spans))
    manifest = BucketManifest(JOB, 1, 1, total, 256 << 10, entries, buckets)
    buffer = allocate_buffer(total)
    pack_into(tensors, entries, buffer)

    unpacked = unpack_views(manifest, buffer)

    for (name, want), (got_name, got) in zip(tensors, unpacked, strict=True):
        assert got_name == name and got.dtype == want.dtype and got.shape == want.shape
        assert got.is_contiguous() and got.untyped_storage().data_ptr() == buffer.data_ptr()
        assert torch.equal(got, want), name


def test_a_manifest_whose_checksums_this_process_cannot_verify_is_refused() -> None:
    entries, total, spans = plan_layout(make_tensors(0), 256 << 10)
    buckets = tuple(BucketEntry(i, o, n, "0" * 32) for i, (o, n) in enumerate(spans))
    manifest = BucketManifest(JOB, 1, 1, total, 256 << 10, entries, buckets)
    assert BucketManifest.from_json(manifest.to_json()) == manifest
    body = json.loads(manifest.to_json())
    body["checksum_algorithm"] = "sha256"

    with pytest.raises(WeightIntegrityError, match="sha256 checksums"):
        BucketManifest.from_json(json.dumps(body).encode())


def test_a_malformed_manifest_is_refused_as_such() -> None:
    entries, total, spans = plan_layout(make_tensors(0), 256 << 10)
    buckets = tuple(BucketEntry(i, o, n, "0" * 32) for i, (o, n) in enumerate(spans))
    good = json.loads(BucketManifest(JOB, 1, 1, total, 256 << 10, entries, buckets).to_json())
    missing = {k: v for k, v in good.items() if k != "tensors"}
    malformed = [b"{not json", b"[1, 2]", json.dumps(missing).encode()]
    malformed.append(json.dumps({**good, "version": None}).encode())
    malformed.append(json.dumps({**good, "checksums": [{"index": 0}] * len(spans)}).encode())
    malformed.append(json.dumps({**good, "tensors": [["w", "uint8"]]}).encode())
    malformed.append(json.dumps({**good, "digest": "0" * 64}).encode())
    # Checksums that do not cut total_bytes into bucket_bytes (a bucket's place is derived
    # from those two).
    malformed.append(json.dumps({**good, "checksums": good["checksums"][:-1]}).encode())
    malformed.append(json.dumps({**good, "bucket_bytes": 0}).encode())
    malformed.append(json.dumps({**good, "bucket_bytes": 128 << 10}).encode())
    # Tensors that do not lie within the buffer as their dtype and shape say.
    for field, value in ((3, total), (4, 3), (1, "complex1024"), (2, [-1, 4])):
        rows = [list(t) for t in good["tensors"]]
        rows[0][field] = value
        malformed.append(json.dumps({**good, "tensors": rows, "digest": None}).encode())

    for raw in malformed:
        with pytest.raises(WeightIntegrityError):
            BucketManifest.from_json(raw)
    assert BucketManifest.from_json(json.dumps(good).encode()).buckets == buckets


async def test_a_manifest_this_release_cannot_read_is_replaced_by_the_next_publish(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """A manifest in the format before this one (a bucket an object), left in etcd across an
    upgrade: reading its epoch failed the trainer's publish of that version."""
    keys = KeySpace(etcd_settings.prefix)
    key = WeightKeys(keys).manifest(JOB, 1)
    old = {"job_id": JOB, "version": 1, "trainer_epoch": 1, "total_bytes": 8, "bucket_bytes": 8}
    old["buckets"] = [{"index": 0, "offset": 0, "nbytes": 8, "checksum": "0" * 32}]
    await etcd_client.put(key, json.dumps(old).encode())
    trainer = UcxTransport(etcd_client, keys, JOB, instance_id="t", epoch=2)
    await trainer.start()
    try:
        await trainer.publish(1, make_tensors(1))
        assert (await _manifest(etcd_client, etcd_settings, 1)).trainer_epoch == 2
    finally:
        await trainer.close()


async def test_a_version_whose_manifest_etcd_cannot_take_is_refused_before_any_write(
    etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    """A manifest over etcd's request limit failed the publish with etcd's own error
    (RESOURCE_EXHAUSTED, 'received message larger than max') and no word of the bucket size.
    A bucket is its checksum in the manifest: 31,250 buckets here, over the limit; 24,000
    (810 GB in 32 MiB buckets) fit."""
    keys = KeySpace(etcd_settings.prefix)
    trainer = UcxTransport(etcd_client, keys, JOB, instance_id="t", bucket_bytes=64)
    await trainer.start()
    try:
        with pytest.raises(ManifestTooLarge, match=r"raise trainer\.weight_bucket_mib"):
            await trainer.publish(1, [("w", torch.zeros(2_000_000, dtype=torch.uint8))])
        assert list(await etcd_client.get_prefix(WeightKeys(keys).announcement(JOB))) == []
        assert trainer.held_versions() == []
    finally:
        await trainer.close()
    # A thousand tensors beside the 24,000 checksums.
    tensors = [(f"model.layers.{i}.mlp.weight", torch.zeros(1, 1)) for i in range(1000)]
    entries = plan_layout(tensors, 1)[0]
    checksums = tuple(BucketEntry(i, 0, 0, "f" * 32) for i in range(24_000))
    big = BucketManifest(JOB, 1, 1, 24_000 * (32 << 20), 32 << 20, entries, checksums)
    manifest_for_etcd(big)


@pytest.mark.gpu
async def test_cuda_tensors_move_device_to_device(
    peers: Any, etcd_client: Any, etcd_settings: EtcdSettings
) -> None:
    trainer, puller = await peers(("trainer", "--device", "cuda"), ("puller", "--device", "cuda"))
    await trainer.call("publish", version=1, seed=4)

    result = await puller.call("pull", version=1)

    assert result["ok"] and result["device"] == "cuda"
    assert result["digest"] == tensors_digest(make_tensors(4))
    # Verified on the GPU: the checksums are ones the GPU computes, not host xxh3.
    assert (await _manifest(etcd_client, etcd_settings, 1)).checksum_algorithm == WSUM128


@pytest.mark.gpu
@pytest.mark.parametrize("publisher", ["cuda", "cpu"])
async def test_a_puller_on_the_other_device_verifies_the_publishers_checksums(
    peers: Any, publisher: str
) -> None:
    puller_device = "cpu" if publisher == "cuda" else "cuda"
    trainer, puller = await peers(
        ("trainer", "--device", publisher), ("puller", "--device", puller_device)
    )
    await trainer.call("publish", version=1, seed=6)

    result = await puller.call("pull", version=1)

    assert result["ok"] and result["device"] == puller_device
    assert result["digest"] == tensors_digest(make_tensors(6))
    assert result["counters"]["checksum_failures"] == 0


@pytest.mark.gpu
async def test_a_corrupt_bucket_in_gpu_memory_is_caught_in_its_run_and_pulled_again(
    peers: Any,
) -> None:
    cuda = ("--device", "cuda")
    trainer, relay, puller = await peers(
        ("trainer", *cuda), ("relay", *cuda, "--corrupt", "1"), ("puller", *cuda)
    )
    # The puller's first pull checks the kernel (in the thread pool); the second is checked
    # in runs on the GPU, as every later one is.
    await trainer.call("publish", version=1, seed=9)
    assert (await puller.call("pull", version=1))["ok"]
    await trainer.call("publish", version=2, seed=10)
    await relay.call("pull", version=2)
    await _sees(puller, 2, "relay")

    result = await puller.call("pull", version=2)

    assert result["ok"] and result["device"] == "cuda"
    assert result["digest"] == tensors_digest(make_tensors(10))
    assert result["counters"]["checksum_failures"] == 1
    by_source = {"relay": N_BUCKETS - 1, "trainer": N_BUCKETS + 1}
    assert result["counters"]["buckets_by_source"] == by_source
