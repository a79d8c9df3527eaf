"""What the leader does for jobs, put together: the JobDriver the server creates owns one of
each part and hands each the few others it works with.

  job_records.py   job records under the leader's guard, per-job locks, parsed specs
  ledgers.py       work ledgers (cached, written, paged out) and ETTR accounts
  asks.py          replacements asked of the provisioner, kept in etcd
  binding.py       binding members: a job's start, replacements, standbys prepared, releases
  work_service.py  LeaseWork, CompleteWork, ReportProgress
  supervision.py   the supervision loop and its round over every job
  executor.py      recovery from incidents (it sees this driver as its `Coordinator`)
  policy/          every recovery decision, as pure functions
"""

from __future__ import annotations

import asyncio

from robustrl.contracts.ettr import EttrAccount, IncidentTiming
from robustrl.contracts.incidents import IncidentRecord
from robustrl.contracts.jobspec import JobSpec
from robustrl.core.fences import FenceSet
from robustrl.core.logs import get_logger
from robustrl.core.registry import Registry
from robustrl.core.runtime import ServiceRuntime
from services.coordinator import work
from services.coordinator.asks import ProvisioningAsks
from services.coordinator.binding import Binder
from services.coordinator.datasets import Datasets
from services.coordinator.executor import RecoveryExecutor
from services.coordinator.job_records import JobRecords
from services.coordinator.jobs import JobRecord, Phase
from services.coordinator.leadership import Leadership
from services.coordinator.ledgers import Ledgers
from services.coordinator.provisioner import Provisioner
from services.coordinator.space import SpaceKeeper
from services.coordinator.store import JobStore
from services.coordinator.supervision import Supervisor
from services.coordinator.work_service import WorkService

log = get_logger(__name__)


class JobDriver:
    def __init__(
        self,
        runtime: ServiceRuntime,
        leadership: Leadership,
        *,
        tick_interval: float,
        lease_seconds: float,
        ledger_page_size: int = work.PAGE_SIZE,
        unreported_loss_after: float = 15.0,
        space: SpaceKeeper | None = None,
    ) -> None:
        """`space`: what gets etcd out of NOSPACE in the leader's rounds; None leaves it to a
        person."""
        self.runtime = runtime
        self.leadership = leadership
        self.jobs = JobRecords(runtime, leadership)
        self.accounting = Ledgers(
            runtime, leadership, page_size=ledger_page_size, lease_seconds=lease_seconds
        )
        self.asks = ProvisioningAsks(runtime, leadership)
        self.datasets = Datasets()
        self.executor = RecoveryExecutor(runtime, self)
        self.binder = Binder(
            runtime,
            self.jobs,
            self.accounting,
            self.datasets,
            self.asks,
            on_bound=self.executor.bound,
            fence=self.executor.fence,
            wake=self.wake,
        )
        self.work = WorkService(
            self.jobs, self.accounting, self.datasets, lease_seconds=lease_seconds
        )
        self.supervisor = Supervisor(
            leadership,
            self.jobs,
            self.accounting,
            self.binder,
            self.datasets,
            self.asks,
            tick_interval=tick_interval,
            unreported_loss_after=unreported_loss_after,
            space=space,
        )

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        self.jobs.start()
        self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()
        await self.executor.stop()
        await self.binder.stop()
        await self.accounting.stop()
        await self.jobs.stop()
        await self.provisioner.close()

    async def on_elected(self) -> None:
        """Reload every job's ledger, ETTR account and asks from etcd (a new leader trusts only
        etcd). Finished jobs too: one that ended just before a failover still gets settled."""
        self.accounting.clear()
        self.asks.clear()
        records, _ = await self.jobs.store.list_all()
        for record, _ in records:
            await self.accounting.reload(record.job_id)
            await self.asks.reload(record.job_id)
        log.info("coordinator.ledgers_reloaded", jobs=len(self.accounting.ledgers))
        await self.binder.follow_fences()
        self.executor.start()

    async def tick(self) -> None:
        """One supervision round now, as the loop runs every tick."""
        await self.supervisor.tick()

    async def delete_job(self, job_id: str, guard: list[object]) -> int:
        return await self.supervisor.delete_job(job_id, guard)

    # ------------------------------------------------------------------ shared state

    @property
    def store(self) -> JobStore:
        return self.jobs.store

    @property
    def registry(self) -> Registry:
        return self.jobs.registry

    @property
    def ledgers(self) -> dict[str, work.WorkLedger]:
        return self.accounting.ledgers

    @property
    def accounts(self) -> dict[str, EttrAccount]:
        return self.accounting.accounts

    @property
    def fences(self) -> FenceSet | None:
        return self.binder.fences

    @property
    def provisioner(self) -> Provisioner:
        return self.asks.provisioner

    @provisioner.setter
    def provisioner(self, provisioner: Provisioner) -> None:
        self.asks.provisioner = provisioner

    def provision_failed(self, job_id: str, role: str) -> None:
        """The provisioner's `on_failure`: ask again at the next round."""
        self.asks.failed(job_id, role)

    def ledger_changed(self, ledger: work.WorkLedger) -> asyncio.Future[None]:
        return self.accounting.changed(ledger)

    # ------------------------------------------------------------------ executor.Coordinator

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    def lock(self, job_id: str) -> asyncio.Lock:
        return self.jobs.lock(job_id)

    async def job(self, job_id: str) -> JobRecord:
        record, _ = await self.jobs.store.get(job_id)
        return record

    def spec(self, record: JobRecord) -> JobSpec:
        return self.jobs.spec(record)

    def ledger_of(self, job_id: str) -> work.WorkLedger | None:
        return self.accounting.ledgers.get(job_id)

    async def save_ledger(self, ledger: work.WorkLedger) -> None:
        await self.accounting.save(ledger)

    async def update_job(
        self,
        job_id: str,
        change: dict[str, object],
        phase: Phase | None = None,
        message: str = "",
    ) -> JobRecord:
        return await self.jobs.update(job_id, change, phase, message)

    async def fail(
        self, job_id: str, message: str, changes: dict[str, object] | None = None
    ) -> None:
        await self.jobs.fail(job_id, message, changes)

    async def account_incident(self, job_id: str, timing: IncidentTiming) -> None:
        await self.accounting.account_incident(job_id, timing)

    def wake(self) -> None:
        self.supervisor.wake()

    async def free_member_lost(self, incident: IncidentRecord) -> None:
        await self.binder.standby_lost(incident)
