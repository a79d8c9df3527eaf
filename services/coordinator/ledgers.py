"""What the leader keeps per running job besides its record: the work ledger (held in memory,
written to etcd after every change, its dropped groups paged out) and the job's ETTR account
(saved on every step, every incident and at the end).

A new leader trusts only etcd: it reloads both at election (`reload`). A ledger it cannot
read costs that job alone (see `reload`); the supervision round fails the job with why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterable

from robustrl.contracts import packed
from robustrl.contracts.errors import Aborted, FailedPrecondition
from robustrl.contracts.ettr import EttrAccount, IncidentTiming, fold_horizon
from robustrl.contracts.ledger import dropped_pages
from robustrl.core.logs import get_logger
from robustrl.core.runtime import ServiceRuntime
from robustrl.v1 import coordinator_pb2
from services.coordinator import work
from services.coordinator.coalesce import CoalescedWrites
from services.coordinator.leadership import Leadership

log = get_logger(__name__)


class Ledgers:
    def __init__(
        self,
        runtime: ServiceRuntime,
        leadership: Leadership,
        *,
        page_size: int,
        lease_seconds: float,
    ) -> None:
        self.runtime = runtime
        self.leadership = leadership
        self.page_size = page_size
        self.lease_seconds = lease_seconds
        self.ledgers: dict[str, work.WorkLedger] = {}
        self.unreadable: dict[str, str] = {}
        """Job -> why its ledger in etcd could not be read at election (`reload`)."""
        self.accounts: dict[str, EttrAccount] = {}
        """ETTR per job, saved at <prefix>/ettr/<job> on every step."""
        self.generated: dict[str, dict[str, tuple[float, float]]] = {}
        """job -> delivered group -> when it was generated, until it trains (then it counts)."""
        self._writes: dict[str, tuple[work.WorkLedger, CoalescedWrites]] = {}
        """Per job, the ledger being written and its writer (`changed`)."""

    async def stop(self) -> None:
        for _, writes in self._writes.values():
            await writes.stop()

    def clear(self) -> None:
        """Before a reload at election: only what etcd holds counts."""
        self.ledgers.clear()
        self.unreadable.clear()

    async def reload(self, job_id: str) -> None:
        """Load one job's ledger and ETTR account. One this leader cannot read (a corrupt value,
        or one that a newer release wrote in a shape this one does not know) costs that job
        alone, never the election: a job whose ledger is unreadable is failed at the next
        tick, since nobody can tell which of its groups were trained; an unreadable ETTR
        account leaves the job running without one. Either value stays in etcd as it was, for
        a person to look at."""
        assert self.runtime.client is not None
        keys = self.runtime.keys
        raw = await self.runtime.client.get(keys.work(job_id))
        if raw is not None:
            try:
                self.ledgers[job_id] = packed.load(work.WorkLedger, raw.value)
            except ValueError as exc:
                detail = " ".join(str(exc).split())  # pydantic's are several lines
                self.unreadable[job_id] = (
                    f"its work ledger at {keys.work(job_id).decode()} cannot be read, so which "
                    f"groups were trained is unknown: {detail[:300]}"
                )
                log.error("coordinator.ledger_unreadable", job=job_id, error=detail)
        raw = await self.runtime.client.get(keys.ettr(job_id))
        if raw is not None:
            try:
                self.accounts[job_id] = packed.load(EttrAccount, raw.value)
            except ValueError as exc:
                self.accounts.pop(job_id, None)
                log.error("coordinator.ettr_account_unreadable", job=job_id, error=str(exc))

    async def open(self, job_id: str) -> None:
        """A job starts: its empty ledger and a new ETTR account, stored before it runs."""
        ledger = work.WorkLedger(job_id=job_id)
        await self.save(ledger)
        self.accounts[job_id] = EttrAccount(started_at=time.time())
        await self.save_account(job_id)
        self.ledgers[job_id] = ledger

    def ledger(self, job_id: str) -> work.WorkLedger:
        ledger = self.ledgers.get(job_id)
        if ledger is None:
            raise FailedPrecondition(f"job {job_id} has no work ledger on this leader yet")
        return ledger

    async def save(self, ledger: work.WorkLedger) -> None:
        """Store the ledger as it is now (`changed`, awaited)."""
        await self.changed(ledger)

    def changed(self, ledger: work.WorkLedger) -> asyncio.Future[None]:
        """A change to the ledger was just made: the future resolves once a write that carries
        it has landed (or fails as that write did). Changes made while a write is in flight
        share the next write (coalesce.CoalescedWrites): await it after letting go of the
        job's lock, and other requests change the ledger meanwhile."""
        known = self._writes.get(ledger.job_id)
        if known is None or known[0] is not ledger:
            known = (ledger, CoalescedWrites(functools.partial(self._write, ledger)))
            self._writes[ledger.job_id] = known
        return known[1].changed()

    async def _write(self, ledger: work.WorkLedger) -> None:
        """Store the ledger; when it lists a page's worth of dropped groups and take-backs,
        move them to a page stored in the same write (the in-memory ledger lets go of them
        only once the write landed, and only of those: others may have come meanwhile)."""
        assert self.runtime.client is not None
        keys, tx = self.runtime.keys, self.runtime.client.transactions
        paged = work.page_out(ledger, self.page_size)
        stored = paged[0] if paged else ledger
        puts = [tx.put(keys.work(ledger.job_id), packed.dump(stored))]
        if paged:
            page_key = keys.dropped_page(ledger.job_id, ledger.pages)
            puts.append(tx.put(page_key, packed.dump(paged[1])))
        ok, _ = await self.runtime.client.transaction(
            compare=self.leadership.guard(), success=puts, failure=[]
        )
        if not ok:
            raise Aborted("lost leadership while saving the work ledger; retry")
        if paged:
            work.forget_paged(ledger, paged[1], stored.pages)
            log.info("coordinator.ledger_paged", job=ledger.job_id, page=stored.pages - 1)

    async def paged_out_drops(self, ledger: work.WorkLedger, groups: Iterable[str]) -> set[str]:
        """Those of `groups` that a page of the job's ledger lists as dropped. The pages are
        read only for ids the ledger alone would take for trained (none, on a normal step)."""
        candidates = work.trained_unless_paged(ledger, groups) if ledger.pages else []
        if not candidates:
            return set()
        assert self.runtime.client is not None
        pages = await dropped_pages(self.runtime.client, self.runtime.keys, ledger.job_id)
        return {g for g in candidates if any(g in page.discarded for page in pages)}

    # ------------------------------------------------------------------ ETTR

    async def save_account(self, job_id: str) -> None:
        account = self.accounts.get(job_id)
        if account is None:
            return
        assert self.runtime.client is not None
        await self.runtime.client.put(self.runtime.keys.ettr(job_id), packed.dump(account))

    def note_generated(self, job_id: str, groups: Iterable[str], start: float, end: float) -> None:
        """These delivered groups were generated from `start` to `end`: kept time once they
        train."""
        spans = self.generated.setdefault(job_id, {})
        for group in groups:
            spans[group] = (start, end)

    def account_progress(
        self, ledger: work.WorkLedger | None, request: coordinator_pb2.ReportProgressRequest
    ) -> None:
        """ETTR: the step is kept time (until a roll back takes it; its wait for data within a
        bound), and so is the generation of every group it trained."""
        account = self.accounts.get(request.job_id)
        if account is None:
            return
        now = time.time()
        started = request.metrics.get("step_started_at", 0.0)
        ended = request.metrics.get("step_ended_at", 0.0)
        if request.step > 0 and ended > started > 0:
            done = [s.step for s in account.steps]
            if done and request.step <= max(done):
                # A restored trainer computes these steps again: the first tries are lost.
                with contextlib.suppress(ValueError):
                    account.roll_back(request.step - 1)
            work_start = request.metrics.get("step_work_started_at")
            account.add_step(request.step, started, ended, work_start=work_start)
        spans = self.generated.get(request.job_id, {})
        for group in request.trained_group_ids:
            span = spans.pop(group, None)
            if span is not None:
                account.add_generation(*span)
        for group in [*request.discarded_groups, *request.regenerate_groups]:
            spans.pop(group, None)
        if request.finished:
            account.end(now)
        horizon = fold_horizon(
            now,
            (start for start, _ in spans.values()),
            (lease.deadline for lease in ledger.open.values()) if ledger else (),
            self.lease_seconds,
        )
        with contextlib.suppress(ValueError):
            # Steps after the trainer's durable checkpoint may still be rolled back.
            account.compact(horizon, checkpoint_step=max(0, request.durable_step))

    async def account_incident(self, job_id: str, timing: IncidentTiming) -> None:
        """An incident's timeline (detected, recovered) in the job's account."""
        account = self.accounts.get(job_id)
        if account is None:
            return
        account.add_incident(timing)
        await self.save_account(job_id)

    async def end_account(self, job_id: str, now: float) -> None:
        account = self.accounts.get(job_id)
        if account is not None and account.ended_at is None:
            account.end(now)
            await self.save_account(job_id)

    def forget(self, job_id: str) -> None:
        for table in (self.ledgers, self.accounts, self.generated):
            table.pop(job_id, None)
        self._writes.pop(job_id, None)
