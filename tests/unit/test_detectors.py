"""The lost-member detector as a pure function of (views, now)."""

from __future__ import annotations

from services.monitor import detectors as d

CFG = d.DetectorConfig(reconnect_grace=1.0)


def beat(
    views: d.Views, now: float, *, goodbye: bool = False, epoch: int = 0, job_id: str = "j"
) -> None:
    d.on_beat(
        views,
        role="rollout",
        instance_id="r0",
        epoch=epoch,
        job_id=job_id,
        rank=0,
        phase="generate",
        counters={"tokens": 1.0},
        goodbye=goodbye,
        now=now,
    )


def reported(views: d.Views, now: float) -> list[d.Finding]:
    findings = d.evaluate(views.values(), now, CFG)
    d.mark_reported(findings)
    return findings


def test_stream_loss_is_lost_only_after_the_reconnect_grace() -> None:
    views: d.Views = {}
    beat(views, 0.0)
    d.on_stream_end(views, "r0", 1.0)
    assert d.evaluate(views.values(), 1.5, CFG) == []
    findings = reported(views, 2.1)
    assert [f.kind for f in findings] == ["MEMBER_LOST"]
    assert "without a goodbye" in findings[0].evidence
    assert findings[0].view.job_id == "j"


def test_a_refused_address_makes_a_broken_stream_lost_before_the_grace() -> None:
    views: d.Views = {}
    beat(views, 0.0)
    d.on_stream_end(views, "r0", 1.0)
    assert d.on_refused(views, "r0", 1.0, "127.0.0.1:9", now=1.1)
    findings = reported(views, 1.01)
    assert [f.kind for f in findings] == ["MEMBER_LOST"]
    assert "127.0.0.1:9 refuses connections" in findings[0].evidence
    assert reported(views, 5.0) == []  # one failure, one incident


def test_a_refusal_counts_only_for_the_stream_end_it_answers() -> None:
    views: d.Views = {}
    beat(views, 0.0)
    d.on_stream_end(views, "r0", 1.0)
    beat(views, 1.1)  # reconnected before the check came back
    assert not d.on_refused(views, "r0", 1.0, "127.0.0.1:9", now=1.1)
    d.on_stream_end(views, "r0", 2.0)
    assert not d.on_refused(views, "r0", 1.0, "127.0.0.1:9", now=1.1)  # an older stream's check
    assert views["r0"].state is d.State.SUSPECT
    beat(views, 2.2, goodbye=True, job_id="")
    assert not d.on_refused(views, "r0", 2.0, "127.0.0.1:9", now=2.1)  # it left properly
    assert d.evaluate(views.values(), 100.0, CFG) == []


def test_reconnect_within_the_grace_is_not_a_failure() -> None:
    views: d.Views = {}
    beat(views, 0.0)
    d.on_stream_end(views, "r0", 1.0)
    beat(views, 1.5)
    assert d.evaluate(views.values(), 10.0, CFG) == []
    assert views["r0"].state is d.State.ALIVE


def test_goodbye_of_a_member_in_no_job_then_deregistration_is_never_an_incident() -> None:
    views: d.Views = {}
    d.on_registered(views, "rollout", "r0", 0, 0.0)
    beat(views, 0.1, job_id="")
    beat(views, 0.2, goodbye=True, job_id="")
    d.on_stream_end(views, "r0", 0.3)
    d.on_unregistered(views, "r0", 0.4)
    assert d.evaluate(views.values(), 100.0, CFG) == []
    assert views["r0"].state is d.State.GONE


def test_goodbye_of_a_member_that_serves_a_job_is_its_loss_at_once() -> None:
    """A clean stop (SIGTERM: a pod deleted, a node drained) while it serves a job."""
    views: d.Views = {}
    d.on_registered(views, "rollout", "r0", 2, 0.0, job_id="j")
    beat(views, 0.1, epoch=2)
    beat(views, 0.2, goodbye=True, epoch=2)
    findings = reported(views, 0.2)
    assert [f.kind for f in findings] == ["MEMBER_LOST"]
    assert findings[0].evidence.startswith("stopped cleanly (a goodbye) while it still served")
    assert (findings[0].view.job_id, findings[0].view.epoch) == ("j", 2)
    d.on_stream_end(views, "r0", 0.3)
    d.on_unregistered(views, "r0", 0.4)
    assert reported(views, 100.0) == []  # one loss, one incident


def test_goodbye_of_any_rank_of_a_trainer_group_still_in_its_job_is_a_loss() -> None:
    """Ranks are members the leader releases when the job ends: one that says goodbye while
    still bound (stopped under it) is lost, and its group with it; one released first is
    gone."""
    views: d.Views = {}
    for job_id, goodbye in (("j", False), ("j", True), ("", False), ("", True)):
        instance = "t1" if job_id else "t2"
        d.on_beat(
            views,
            role="trainer",
            instance_id=instance,
            epoch=1,
            job_id=job_id,
            rank=1 if job_id else 0,
            phase="train",
            counters={},
            goodbye=goodbye,
            now=0.1,
        )
    [lost] = d.evaluate(views.values(), 100.0, CFG)
    assert (lost.kind, lost.view.instance_id, lost.view.rank) == ("MEMBER_LOST", "t1", 1)
    assert views["t2"].state is d.State.GONE


def test_the_address_comes_from_the_registry_and_outlives_beats() -> None:
    views: d.Views = {}
    d.on_registered(views, "rollout", "r0", 0, 0.0, "127.0.0.1:7")
    beat(views, 0.1)
    d.on_registered(views, "rollout", "r0", 0, 0.2)  # a record seen without an address
    d.on_stream_end(views, "r0", 0.3)
    assert views["r0"].address == "127.0.0.1:7"


def test_lease_expiry_without_goodbye_is_lost_at_once() -> None:
    views: d.Views = {}
    d.on_registered(views, "trainer", "t0", 0, 0.0)
    d.on_unregistered(views, "t0", 5.0)
    findings = reported(views, 5.0)
    assert len(findings) == 1 and "lease expired" in findings[0].evidence


def test_a_lease_lapsed_while_the_member_beats_is_not_a_loss() -> None:
    # etcd unreachable for longer than the TTL: every lease lapses when it answers again,
    # while the heartbeat streams (to the monitor, not through etcd) never stopped.
    views: d.Views = {}
    d.on_registered(views, "rollout", "r0", 0, 0.0)
    beat(views, 9.6)
    assert d.on_unregistered(views, "r0", 10.0, beating_within=2.0)
    assert reported(views, 10.0) == [] and views["r0"].state is d.State.ALIVE
    d.on_registered(views, "rollout", "r0", 0, 10.5)  # it registers again by itself
    assert views["r0"].registered and reported(views, 11.0) == []


def test_a_lease_lapsed_after_the_beats_stopped_is_a_loss() -> None:
    # A frozen process keeps its stream open but sends nothing: its lease lapsing is a loss.
    views: d.Views = {}
    d.on_registered(views, "rollout", "r0", 0, 0.0)
    beat(views, 1.0)
    assert not d.on_unregistered(views, "r0", 9.0, beating_within=2.0)
    [finding] = reported(views, 9.0)
    assert "lease expired" in finding.evidence


def test_one_incident_per_loss() -> None:
    views: d.Views = {}
    beat(views, 0.0)
    d.on_stream_end(views, "r0", 0.0)
    assert len(reported(views, 2.0)) == 1
    d.on_unregistered(views, "r0", 5.0)  # the lease expiring later adds nothing
    assert reported(views, 6.0) == []


def test_a_late_beat_from_a_lost_instance_revives_nothing_but_a_new_epoch_does() -> None:
    views: d.Views = {}
    beat(views, 0.0, epoch=1)
    d.on_stream_end(views, "r0", 0.0)
    reported(views, 2.0)
    beat(views, 3.0, epoch=1)
    assert views["r0"].state is d.State.LOST
    beat(views, 4.0, epoch=2)
    assert views["r0"].state is d.State.ALIVE and views["r0"].epoch == 2


def test_a_member_lost_while_free_is_seen_again_once_bound_to_a_job_at_any_epoch() -> None:
    """Epochs count per job: a member lost while free (released from a job at epoch 3), back
    after a partition and bound to another job at epoch 1, is a new incarnation; its beats
    and its registry record must not be taken as late, or its hangs would never be seen."""
    views: d.Views = {}
    beat(views, 0.0, epoch=3, job_id="")
    d.on_stream_end(views, "r0", 0.0)
    assert len(reported(views, 2.0)) == 1
    beat(views, 3.0, epoch=3, job_id="")  # still the lost incarnation
    d.on_registered(views, "rollout", "r0", 3, 3.0, "h:1", "")
    assert views["r0"].state is d.State.LOST
    d.on_registered(views, "rollout", "r0", 1, 4.0, "h:1", "job-b")
    assert views["r0"].state is d.State.ALIVE and views["r0"].registered
    beat(views, 4.5, epoch=1, job_id="job-b")
    assert views["r0"].state is d.State.ALIVE and views["r0"].job_id == "job-b"
    assert views["r0"].epoch == 1
