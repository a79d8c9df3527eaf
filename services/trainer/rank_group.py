"""A trainer member's place in its job's rank group (`trainer.world_size` > 1, or an fsdp job):
rank 0 hosts the group and publishes where it meets (`HostedGroup`); a rank > 0 finds that
meeting in etcd and follows rank 0 until the job's work is done (`follow_group`). The
worker (worker.py) runs one or the other."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robustrl.contracts.jobspec import JobSpec
from robustrl.core.aio import cancel_and_wait
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from services.trainer import follower
from services.trainer.devices import Compute
from services.trainer.publishing import hold_share, open_transport, share_settings
from services.trainer.ranks import LeaderRanks, PackedShare, RankGroup, ShareSettings, rendezvous

if TYPE_CHECKING:
    import torch

    from services.trainer.grpo import GRPOTrainer

log = get_logger(__name__)

RANKS_TIMEOUT_S = 300.0
"""How long ranks wait for each other: in the rendezvous, in the group's forming, in a
collective (the monitor names a stuck rank long before, within its collective budget)."""


class HostedGroup:
    """Rank 0's side: its `LeaderRanks`, and the rendezvous record it keeps published while the
    group lives."""

    def __init__(
        self,
        runtime: ServiceRuntime,
        *,
        job_id: str,
        epoch: int,
        world_size: int,
        compute: Compute,
        sharded: bool,
        shares: ShareSettings | None = None,
    ) -> None:
        self.runtime = runtime
        self.job_id = job_id
        self.epoch = epoch
        self.world_size = world_size
        host = runtime.settings.resolved_advertise_host()
        self.ranks = LeaderRanks(
            runtime.progress,
            world_size=world_size,
            timeout_s=RANKS_TIMEOUT_S,
            host=host,
            backend=compute.backend,
            sharded=sharded,
            epoch=epoch,
            address=_ipv4_or_empty(host),
            shares=shares,
        )
        self.meeting: rendezvous.Rendezvous | None = None
        self._republish: asyncio.Task[None] | None = None

    async def start(
        self,
        trainer: GRPOTrainer,
        *,
        check: Callable[[], None],
        restore_from: Path | None,
        step: int,
    ) -> None:
        """Host the rendezvous, publish where the group meets for this epoch, wait for ranks
        1..N-1 (trainer members the leader bound with this one) and give them this rank's
        (maybe restored) state (FSDP2 ranks read their parts of the restored checkpoint)."""
        runtime = self.runtime
        assert runtime.client is not None and runtime.session is not None
        master = await asyncio.to_thread(self.ranks.listen)
        if self.world_size > 1:
            self.meeting = rendezvous.Rendezvous(
                job_id=self.job_id, epoch=self.epoch, master=master, world_size=self.world_size
            )
            await rendezvous.publish(
                runtime.client, runtime.keys, self.meeting, runtime.session.lease_id
            )
            self._republish = asyncio.create_task(self._keep_published(self.meeting))
        await asyncio.to_thread(
            self.ranks.start, trainer, check=check, restore_from=restore_from, step=step
        )
        log.info(
            "trainer.ranks_started", job=self.job_id, world_size=self.world_size, master=master
        )

    async def _keep_published(self, meeting: rendezvous.Rendezvous) -> None:
        """The record lives under this member's session lease (it goes with the process): when
        the session lapses (an etcd outage, a stalled loop) and a new one is opened, write it
        again under the new lease, or ranks still joining would never find it."""
        runtime = self.runtime
        session = runtime.session
        while True:
            session = await runtime.next_session(after=session)
            assert runtime.client is not None
            try:
                await rendezvous.publish(runtime.client, runtime.keys, meeting, session.lease_id)
            except Exception as exc:  # etcd away again: the next session writes it
                log.warning("trainer.rendezvous_unpublished", job=self.job_id, error=repr(exc))
            else:
                log.info("trainer.rendezvous_republished", job=self.job_id, epoch=meeting.epoch)

    async def close(self) -> None:
        """Tell the other ranks the work is done, leave the group, withdraw the record."""
        await asyncio.to_thread(self.ranks.close)
        await cancel_and_wait(self._republish)
        meeting, self.meeting = self.meeting, None
        if meeting is not None and self.runtime.client is not None:
            with contextlib.suppress(Exception):  # etcd away: rank 0's lease takes it later
                await rendezvous.withdraw(self.runtime.client, self.runtime.keys, meeting)


async def follow_group(
    runtime: ServiceRuntime,
    *,
    job_id: str,
    epoch: int,
    rank: int,
    spec: JobSpec,
    compute: Compute,
    model: torch.nn.Module,
    tokenizer: Any,
) -> None:
    """Rank > 0: meet rank 0 where it published this epoch's rendezvous, then follow it
    (`follower.follow`, in a daemon thread: a rank stuck in a collective is not waited for on
    the way out) until it says the job's work is done. An FSDP2 rank serves its share of each
    version over a weight transport of its own. Raises `Fenced` if a newer epoch's group meets
    instead, and what broke the group."""
    assert runtime.client is not None
    progress = runtime.progress
    progress.rank = rank
    progress.enter("starting_ranks")
    meeting = await rendezvous.meet(runtime.client, runtime.keys, job_id, epoch, RANKS_TIMEOUT_S)
    group = RankGroup(
        rank,
        meeting.world_size,
        meeting.master,
        progress,
        RANKS_TIMEOUT_S,
        backend=compute.backend,
        sharded=spec.trainer.strategy == "fsdp",
        address=_ipv4_or_empty(runtime.settings.resolved_advertise_host()),
        epoch=epoch,
    )
    log.info("trainer.rank_joining", job=job_id, rank=rank, master=meeting.master)
    transport = None
    if spec.trainer.strategy == "fsdp":
        transport = await open_transport(runtime, spec, job_id, epoch)
    try:
        shares = None if transport is None else share_settings(spec, transport, compute.device)
        loop = asyncio.get_running_loop()
        holding: set[asyncio.Future[None]] = set()

        def on_share(version: int, packed: PackedShare) -> None:
            assert transport is not None
            future = asyncio.run_coroutine_threadsafe(hold_share(transport, packed, version), loop)
            holding.add(asyncio.wrap_future(future, loop=loop))

        await _in_daemon_thread(
            lambda: follower.follow(
                group, spec, model, tokenizer, progress, shares=shares, on_share=on_share
            ),
            name=f"rank{rank}",
        )
        log.info("trainer.rank_finished", job=job_id, rank=rank)
        if transport is not None:
            # Its share is served until the member is released: a rollout may still be
            # pulling the last version.
            await asyncio.Event().wait()
    finally:
        for task in holding:
            task.cancel()
        if transport is not None:
            await transport.close()


async def _in_daemon_thread(work: Callable[[], None], name: str) -> None:
    """Run `work` in a daemon thread (with the caller's log context) and wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            work()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone already
            loop.call_soon_threadsafe(settle, error)

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()
    await done


def _ipv4_or_empty(host: str) -> str:
    """`host` if it is an IPv4 address (the ranks then listen on its interface), else "": gloo
    and NCCL pick the interface the host name resolves to."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return ""
    return host
