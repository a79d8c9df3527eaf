"""The external provisioner's bookkeeping: which scheduler gets a request, and that nothing
asked for is dropped when schedulers come and go (the gRPC stream around it is tested in
tests/integration/test_provisioning.py and end to end in tests/chaos/test_recovery.py), and
that the local provisioner leaves no directory behind before it starts anyone; and which
replacements the leader counts as coming."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from robustrl.contracts.errors import AlreadyExists, InvalidArgument, NotFound
from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings
from robustrl.v1 import common_pb2, provisioning_pb2
from services.coordinator.asks import ProvisioningAsks
from services.coordinator.provisioner import ExternalProvisioner, LocalProvisioner, Scheduler


def hello(name: str, *roles: common_pb2.Role.ValueType) -> provisioning_pb2.ProvisionerHello:
    return provisioning_pb2.ProvisionerHello(name=name, roles=roles)


def sent(scheduler: Scheduler) -> list[provisioning_pb2.ProvisionRequest]:
    out = []
    while not scheduler.outbox.empty():
        out.append(scheduler.outbox.get_nowait())
    return out


def done(request_id: str, ok: bool = True) -> provisioning_pb2.ProvisionReport:
    return provisioning_pb2.ProvisionReport(request_id=request_id, ok=ok, error="" if ok else "no")


@pytest.fixture
def provisioner() -> ExternalProvisioner:
    return ExternalProvisioner(EtcdSettings(endpoints="etcd-a:2379", prefix="/rl"))


async def test_a_request_carries_what_the_member_needs(provisioner: ExternalProvisioner) -> None:
    slurm = provisioner.connect(hello("slurm"))
    member = await provisioner.request("trainer", "job-1", "replacement", standby=True)
    [request] = sent(slurm)
    assert request.instance_id == member and member.startswith("standby-p")
    assert request.role == common_pb2.ROLE_TRAINER and request.standby
    assert request.job_id == "job-1" and request.reason == "replacement"
    assert request.env["ROBUSTRL_ETCD_ENDPOINTS"] == "etcd-a:2379"
    assert request.env["ROBUSTRL_ETCD_PREFIX"] == "/rl"
    assert request.env["ROBUSTRL_TRAINER_INSTANCE_ID"] == member
    assert request.env["ROBUSTRL_TRAINER_STANDBY"] == "true"
    assert request.argv[-1] == "services.trainer"


async def test_requests_wait_for_a_scheduler_and_outlive_one_that_leaves(
    provisioner: ExternalProvisioner,
) -> None:
    await provisioner.request("rollout", "job-1", "r1")  # nobody connected yet
    trainers_only = provisioner.connect(hello("k8s", common_pb2.ROLE_TRAINER))
    assert sent(trainers_only) == []  # it does not offer rollouts
    first = provisioner.connect(hello("slurm-a", common_pb2.ROLE_ROLLOUT))
    [waiting] = sent(first)
    provisioner.disconnect(first)  # its stream broke before it reported
    second = provisioner.connect(hello("slurm-b"))
    assert sent(second) == [waiting]
    with pytest.raises(NotFound):
        provisioner.report(first, done(waiting.request_id))  # not the one it went to
    provisioner.report(second, done(waiting.request_id))
    assert provisioner.pending == {}
    with pytest.raises(NotFound):
        provisioner.report(second, done(waiting.request_id))  # reported once only


async def test_requests_spread_over_schedulers_and_a_failure_is_asked_again(
    provisioner: ExternalProvisioner,
) -> None:
    failed: list[tuple[str, str]] = []
    provisioner.on_failure = lambda job, role: failed.append((job, role))
    a, b = provisioner.connect(hello("a")), provisioner.connect(hello("b"))
    for _ in range(4):
        await provisioner.request("rollout", "job-2", "r")
    from_a, from_b = sent(a), sent(b)
    assert len(from_a) == len(from_b) == 2
    provisioner.report(a, done(from_a[0].request_id, ok=False))
    assert failed == [("job-2", "rollout")]
    await provisioner.request("trainer", "job-2", "standby", standby=True)
    [standby] = sent(a)  # a has the fewest outstanding now
    provisioner.report(a, done(standby.request_id, ok=False))
    # A standby counts as a replacement coming for the job: once it will not come, the job's
    # next loss of a trainer asks at once.
    assert failed == [("job-2", "rollout"), ("job-2", "trainer")]


def test_bad_hellos_are_refused(provisioner: ExternalProvisioner) -> None:
    provisioner.connect(hello("slurm"))
    with pytest.raises(AlreadyExists):
        provisioner.connect(hello("slurm"))
    with pytest.raises(InvalidArgument, match="name"):
        provisioner.connect(hello(""))
    with pytest.raises(InvalidArgument, match="only trainer, rollout"):
        provisioner.connect(hello("x", common_pb2.ROLE_COORDINATOR))
    assert list(provisioner.schedulers) == ["slurm"]


async def test_a_role_nobody_provisions_is_refused(provisioner: ExternalProvisioner) -> None:
    with pytest.raises(ValueError, match="cannot provision a monitor"):
        await provisioner.request("monitor", "job-1", "r")
    assert provisioner.pending == {}


def test_a_local_provisioner_makes_its_log_directory_only_for_a_member(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every coordinator started one at construction: make test left hundreds of empty
    # directories in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    etcd = EtcdSettings(endpoints="127.0.0.1:1", prefix="/rl")
    local = LocalProvisioner(None, KeySpace("/rl"), etcd)
    assert local.log_dir is None and list(tmp_path.iterdir()) == []
    named = LocalProvisioner(None, KeySpace("/rl"), etcd, str(tmp_path / "logs"))
    assert named.log_dir == tmp_path / "logs" and list(tmp_path.iterdir()) == []


class InMemoryAsks(ProvisioningAsks):
    """The asks' bookkeeping without etcd: what would be stored is not."""

    async def save(self, job_id: str) -> None:
        return None


async def test_a_standby_refill_counts_as_a_replacement_coming(
    provisioner: ExternalProvisioner,
) -> None:
    asks = InMemoryAsks(runtime=None, leadership=None)  # type: ignore[arg-type]
    asks.provisioner = provisioner
    bound = MemberRecord(role="rollout", instance_id="sr0", address="h:1", pid=1, host="h")
    await asks.replace_standby("j", bound)
    # The job loses a rollout before the refill registered: no cold rollout as well.
    await asks.ask("j", "rollout", 1, set())
    assert [(p.role, p.message.standby) for p in provisioner.pending.values()] == [
        ("rollout", True)
    ]
    # The refill will not come (its scheduler said so): the next round asks at once.
    asks.failed("j", "rollout")
    await asks.ask("j", "rollout", 1, set())
    assert sorted(p.message.standby for p in provisioner.pending.values()) == [False, True]
