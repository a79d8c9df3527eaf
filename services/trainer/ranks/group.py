"""One rank's membership of the gloo group: the rendezvous, the collectives a step runs, and
the watchdog that numbers each collective and reports the phase `collective` while a rank is
inside one (the package docstring tells how the monitor reads them)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from robustrl.core.heartbeat import Progress
from robustrl.core.logs import get_logger
from services.trainer.ranks.sharding import gather_full
from services.trainer.ranks.step import EvalOrder, Order, SaveOrder, StepOrder

log = get_logger(__name__)

IDLE_WAIT = timedelta(days=365)
"""How long a follower waits for rank 0's next batch: as long as it takes. Rank 0 going away
ends the wait at once (the store's connection drops)."""

_JOINED = "robustrl/joined/{rank}"
_GO = "robustrl/go/{n}"
_EPOCH = "robustrl/epoch"


class WrongGroup(RuntimeError):
    """The store a rank reached belongs to another epoch's group (the rendezvous moved on)."""


class RankGroup:
    """One rank's membership of the gloo group, with every collective it runs watched."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master: str,
        progress: Progress,
        timeout_s: float,
        *,
        warn_after: float | None = None,
        backend: str = "gloo",
        sharded: bool = False,
        address: str = "",
        epoch: int = 0,
    ) -> None:
        """`backend`: the process group's (gloo; "cpu:gloo,cuda:nccl" for CUDA ranks).
        `sharded`: an FSDP2 group (`sharding.py`), which also opens a second gloo group for
        the checkpoint writes. `address`: this rank's own address, where the other ranks
        reach it (default: the address its host name resolves to, as gloo and NCCL take it;
        often 127.0.0.1, which another host cannot reach). `epoch`: the trainer epoch the
        group serves; rank 0's store holds it, and a rank of another epoch refuses to join
        (`WrongGroup`)."""
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master {master!r} is not host:port")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = int(port)
        self.progress = progress
        self.timeout = timedelta(seconds=timeout_s)
        self.warn_after = warn_after if warn_after is not None else min(30.0, timeout_s / 2)
        self.backend = backend
        self.sharded = sharded
        self.address = address
        self.epoch = epoch
        self.checkpoint_group: dist.ProcessGroup | None = None
        """An FSDP2 group's second gloo group, for DCP's writes in their own thread."""
        self.seq = 0
        self.broken = False
        """A collective failed: the group cannot be used again (close it)."""
        self._store: dist.TCPStore | None = None
        self._signals: dist.TCPStore | None = None
        self._broadcasts = 0
        self._initialised = False
        self._current: tuple[str, int, float] | None = None
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        progress.rank = rank
        progress.set_counter("collective_seq", 0.0)

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ set-up

    def listen(self) -> str:
        """Rank 0: open the rendezvous store (port 0 picks a free one); returns host:port."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 hosts the rendezvous store")
        if self._store is None:
            self._store = dist.TCPStore(
                self.host,
                self.port,
                self.world_size,
                is_master=True,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            self._store.set(_EPOCH, str(self.epoch))
            self.port = int(self._store.port)
        return self.master

    def init(self, check: Callable[[], None] | None = None) -> None:
        """Join the group; blocks until every rank has (at most the timeout).

        Rank 0 waits for each other rank to announce itself before the gloo rendezvous, and
        calls `check` while it waits (it raises to give up: rank 0's trainer was stopped or
        fenced meanwhile). Another rank checks that the store serves its epoch first.
        """
        if self.rank == 0:
            self.listen()
            assert self._store is not None
            store = self._store
            waiting = [_JOINED.format(rank=r) for r in range(1, self.world_size)]
            deadline = time.monotonic() + self.timeout.total_seconds()
            # The join is collective #0: a rank that never joins is named like a rank that
            # never enters a collective, without counting it (every rank's numbers start at 1).
            before = self.progress.phase
            self.progress.enter("collective")
            try:
                while waiting and not store.check(waiting):
                    if check is not None:
                        check()
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"trainer ranks did not join within {self.timeout.total_seconds():.0f}s"
                        )
                    time.sleep(0.05)
            finally:
                self.progress.enter(before)
        else:
            store = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=False, timeout=self.timeout
            )
            # A second connection for the idle wait between steps, which has no timeout.
            self._signals = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=False, timeout=IDLE_WAIT
            )
            found = int(store.get(_EPOCH).decode())
            if found != self.epoch:
                raise WrongGroup(
                    f"the store at {self.master} serves the group of epoch {found}; this rank "
                    f"was bound at epoch {self.epoch}"
                )
            store.set(_JOINED.format(rank=self.rank), "1")
            self._store = store
        if self.address:
            # gloo and NCCL pick the interface to listen on by name, not by address.
            try:
                interface = interface_for(self.address)
            except ValueError as exc:  # behind NAT: the host name's interface it is
                log.warning("trainer.rank_interface_unknown", address=self.address, error=str(exc))
            else:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        self._initialised = True
        if self.sharded:
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=self.timeout)
        self._watchdog = threading.Thread(target=self._watch, name="collective-watchdog")
        self._watchdog.daemon = True
        self._watchdog.start()
        log.info("trainer.rank_joined", rank=self.rank, world_size=self.world_size)

    def close(self) -> None:
        """Leave the group (idempotent). Drops `collective_seq` from the beats."""
        self._closed.set()
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(Exception):  # after a peer died; nothing left to do
                dist.destroy_process_group()
        self._store = self._signals = None
        self.checkpoint_group = None
        counters = {k: v for k, v in self.progress.counters.items() if k != "collective_seq"}
        self.progress.counters = counters

    # ------------------------------------------------------------------ the watchdog

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[int]:
        """Number the collective run inside, and report phase `collective` while in it.

        The phase the rank was in comes back afterwards with a fresh start time: the wait
        was covered by the collective budget, and counting it again against that phase's
        own budget would call a slow peer a hang of this rank.
        """
        self.seq += 1
        seq, before, since = self.seq, self.progress.phase, time.monotonic()
        self.progress.set_counter("collective_seq", float(seq))
        self.progress.enter("collective")
        self._current = (name, seq, since)
        log.debug("trainer.collective", name=name, seq=seq, rank=self.rank)
        try:
            yield seq
        except Exception as exc:
            self.broken = True
            log.error(
                "trainer.collective_failed",
                name=name,
                seq=seq,
                rank=self.rank,
                waited=round(time.monotonic() - since, 1),
                error=str(exc).splitlines()[0] if str(exc) else repr(exc),
            )
            raise
        finally:
            self._current = None
            self.progress.enter(before)

    def _watch(self) -> None:
        warned = 0
        while not self._closed.wait(1.0):
            current = self._current
            if current is None:
                continue
            name, seq, since = current
            waited = time.monotonic() - since
            if seq != warned and waited >= self.warn_after:
                warned = seq
                log.warning(
                    "trainer.collective_waiting",
                    name=name,
                    seq=seq,
                    rank=self.rank,
                    waited=round(waited, 1),
                )

    # ------------------------------------------------------------------ collectives

    def broadcast_batch(
        self, order: Order | None, *, timeout_s: float | None = None
    ) -> Order | None:
        """Rank 0 sends `order` (None: stop) to every rank; every rank returns it.

        Followers pass None and first wait, idle and without a timeout, until rank 0 is
        about to send.
        """
        self._broadcasts += 1
        go = _GO.format(n=self._broadcasts)
        if self.rank == 0:
            assert self._store is not None
            self._store.set(go, "1")
        else:
            assert self._signals is not None
            self._signals.wait([go])
        with self.collective("broadcast_batch"):
            received = self._broadcast_object(order, timeout_s)
        if self.rank == 0:
            assert self._store is not None
            # Every rank waited for this key before it could join the broadcast just done.
            self._store.delete_key(go)
        return received if isinstance(received, StepOrder | SaveOrder | EvalOrder) else None

    def broadcast_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes rank 0's parameters, buffers and optimizer state."""
        with self.collective("broadcast_state"):
            tensors = list(model.state_dict().values())
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                if self.rank == 0:
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                else:
                    flat = torch.empty(sum(t.numel() for t in same), dtype=dtype)
                dist.broadcast(flat, src=0)
                if self.rank != 0:
                    offset = 0
                    with torch.no_grad():
                        for t in same:
                            t.copy_(flat[offset : offset + t.numel()].view_as(t))
                            offset += t.numel()
            state = self._broadcast_object(optimizer.state_dict() if self.rank == 0 else None)
            if self.rank != 0:
                assert isinstance(state, dict)
                optimizer.load_state_dict(state)

    def sync_gradients(self, model: torch.nn.Module, *, nonfinite: bool = False) -> bool:
        """Sum every parameter's gradient over the ranks, in one flattened all-reduce.

        A sum, not a mean: each rank's loss is already divided by the whole batch's token
        count, so the sum is the batch's gradient. A parameter no rank has a gradient for
        keeps none, as in a single-rank step. `nonfinite` (this rank saw a NaN/Inf) rides in
        the same all-reduce; returns whether any rank did.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        parts = [
            p.grad.detach().reshape(-1).float()
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=torch.float32)
            for p in params
        ]
        has_grad = [1.0 if p.grad is not None else 0.0 for p in params]
        flat = torch.cat([*parts, torch.tensor([*has_grad, 1.0 if nonfinite else 0.0])])
        with self.collective("sync_gradients"):
            dist.all_reduce(flat)
        offset = 0
        flags = flat[-len(params) - 1 :]
        for i, p in enumerate(params):
            summed = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if flags[i] == 0:
                p.grad = None
            elif p.grad is not None:
                p.grad.copy_(summed)
            else:
                p.grad = summed.to(p.dtype).clone()
        return bool(flags[-1] > 0)

    def share_start(self, restore_from: str, step: int) -> tuple[str, int]:
        """Rank 0's checkpoint to restore at the start (a sharded one, read by every rank; ""
        for none) and the step it starts at, on every rank."""
        with self.collective("share_start"):
            received = self._broadcast_object((restore_from, step) if self.rank == 0 else None)
        assert isinstance(received, tuple)
        return received

    def gather_weights(self, model: torch.nn.Module) -> dict[str, Any]:
        """An FSDP2 model's whole weights on the CPU of rank 0 ({} on the others)."""
        with self.collective("gather_weights"):
            return gather_full(model)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (unwatched: call it inside a watched step)."""
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t)
        return bool(t.item() > 0)

    def every_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on every rank (unwatched, as `any_rank`)."""
        return not self.any_rank(not flag)

    def gather_step(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's `values` (same length everywhere), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.collective("gather_step"):
            dist.all_gather(rows, mine)
        return [row.tolist() for row in rows]

    def _broadcast_object(self, obj: object, timeout_s: float | None = None) -> object:
        """Rank 0's `obj` on every rank (pickled: ranks of one job trust each other)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.broadcast(size, src=0, async_op=True), timeout_s)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.broadcast(data, src=0, async_op=True), timeout_s)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    @staticmethod
    def _wait(work: dist.Work | None, timeout_s: float | None) -> None:
        assert work is not None
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))


def interface_for(address: str) -> str:
    """The name of this host's network interface that holds IPv4 `address`; ValueError if
    none does."""
    wanted = ipaddress.IPv4Address(address)
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:  # no IPv4 address on it
                continue
            if ipaddress.IPv4Address(reply[20:24]) == wanted:
                return name
    raise ValueError(f"no network interface of this host holds {address}")
