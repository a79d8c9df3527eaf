"""Role-aware detectors over members' progress signals — pure functions of (signals, now).

Each knows what normal looks like for its role, so normal RL behaviour never fires:
- rollout hang: no new tokens for `rollout_hang_window` while requests are in flight. Tokens
  still flowing (a long-tail generation) or no requests (idle, waiting for weights) never
  count. A suspect is only *probed*; the monitor confirms with an active probe first.
- trainer hang: a phase running longer than its own budget. Waiting for data has no budget.
- collective hang: ranks waiting in collective number N past its budget while another rank of
  the same job has not entered N: that rank is named.
- non-finite: a NaN/Inf counter of a member grew, reported with where (loss, grad, weights,
  logprobs) and the step, in the beat that carried it.
- degraded: a rollout far below its peers' median throughput (a warning, not a failure).
- silent: a member whose heartbeat stream is open but carries no beat for `silence_window`
  (the whole process is frozen: SIGSTOP, a stuck interpreter). Only probed, like a rollout
  hang suspect: the monitor confirms with a deadline before it calls it a hang.

`evaluate` runs them all and leaves out what was already reported: every finding carries a
key naming the episode it is about (a phase run, a collective number), reported once.
Phase start times are the member's clock; hosts are assumed NTP-synchronised to well under
a budget.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NONFINITE_COUNTERS = ("nonfinite_loss", "nonfinite_grad", "nonfinite_weights", "nonfinite_logprobs")


@dataclass(frozen=True)
class ProgressConfig:
    rollout_hang_window: float = 10.0
    """Seconds without a new token, with requests in flight, before a rollout is probed."""

    phase_budgets: dict[str, float] = field(
        default_factory=lambda: {
            "forward_backward": 120.0,
            "optimizer": 60.0,
            "checkpoint": 300.0,
            "publish": 120.0,
            "eval": 300.0,
        }
    )
    """Seconds each trainer phase may take; phases not listed (waiting_data) have no budget."""

    collective_budget: float = 30.0
    """Seconds ranks may wait in one collective before the laggard is named."""

    degraded_ratio: float = 0.3
    """A rollout below this fraction of its peers' median tokens/s is degraded."""

    silence_window: float = 3.0
    """Seconds without a beat on an open heartbeat stream before the member is probed."""


FAILURE_KINDS = ("TRAINER_HANG", "COLLECTIVE_HANG")
"""Findings that mean the member failed (recovery replaces it), not a warning."""

PROBED_KINDS = ("ROLLOUT_HANG_SUSPECT", "SILENT")
"""Findings that are only suspicions: the monitor probes the member before it reports."""


@dataclass
class Signals:
    """What the monitor tracks per member between beats (updated by `observe`)."""

    role: str
    instance_id: str
    job_id: str = ""
    rank: int = 0
    phase: str = ""
    phase_started_at: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    tokens_changed_at: float | None = None
    """When tokens last grew (or the member was last idle); None before the first beat."""
    last_beat_at: float | None = None
    assigned_job: str = ""
    assigned_rank: int = 0
    """The job and rank of its registry record: what the coordinator bound it to, known before
    (or without) a beat that says so."""
    reported: set[str] = field(default_factory=set)
    """Keys of the episodes already reported (see `ProgressFinding.key`)."""


@dataclass(frozen=True)
class ProgressFinding:
    kind: str  # ROLLOUT_HANG_SUSPECT, SILENT, TRAINER_HANG, COLLECTIVE_HANG, NON_FINITE, DEGRADED
    instance_id: str
    job_id: str
    rank: int
    evidence: str
    confidence: float
    key: str = ""
    """The episode this is about; a key is reported once per member."""
    seen_at: float | None = None
    """When the detector could first see it (its incident's detected_at); None: now."""

    @property
    def needs_probe(self) -> bool:
        return self.kind in PROBED_KINDS


def engine_work(counters: dict[str, float]) -> float:
    """What a rollout's engine is asked to do now: its requests in flight, and a weight update
    it is loading (both must end or make tokens, or the engine is hung)."""
    return counters.get("requests_in_flight", 0.0) + counters.get("weight_updates_in_flight", 0.0)


def observe(
    signals: Signals,
    *,
    phase: str,
    phase_started_at: float,
    counters: dict[str, float],
    now: float,
) -> None:
    """Fold one beat into the member's signals."""
    before = signals.counters.get("tokens_generated", 0.0)
    in_flight = engine_work(counters)
    if (
        counters.get("tokens_generated", 0.0) > before
        or in_flight == 0
        or signals.tokens_changed_at is None
    ):
        # New tokens, or nothing asked of it: the hang clock starts over.
        signals.tokens_changed_at = now
    signals.phase, signals.phase_started_at = phase, min(phase_started_at, now)
    signals.counters = dict(counters)
    signals.last_beat_at = now


def rollout_hang_suspects(
    members: list[Signals], now: float, cfg: ProgressConfig
) -> list[ProgressFinding]:
    out = []
    for m in members:
        if m.role != "rollout" or engine_work(m.counters) <= 0:
            continue
        if m.tokens_changed_at is None:
            continue
        silent = now - m.tokens_changed_at
        if silent >= cfg.rollout_hang_window:
            requests = m.counters.get("requests_in_flight", 0.0)
            asked = (
                f"{requests:.0f} requests in flight" if requests else "a weight update in flight"
            )
            out.append(
                ProgressFinding(
                    "ROLLOUT_HANG_SUSPECT",
                    m.instance_id,
                    m.job_id,
                    m.rank,
                    f"no new tokens for {silent:.1f}s with {asked}",
                    0.6,
                    key=f"hang@{m.tokens_changed_at}",
                )
            )
    return out


def trainer_hangs(members: list[Signals], now: float, cfg: ProgressConfig) -> list[ProgressFinding]:
    out = []
    for m in members:
        budget = cfg.phase_budgets.get(m.phase)
        if m.role != "trainer" or budget is None or not m.phase_started_at:
            continue
        took = now - m.phase_started_at
        if took > budget:
            out.append(
                ProgressFinding(
                    "TRAINER_HANG",
                    m.instance_id,
                    m.job_id,
                    m.rank,
                    f"phase {m.phase} running for {took:.0f}s, over its {budget:.0f}s budget "
                    f"(step {m.counters.get('step', 0):.0f})",
                    0.9,
                    key=f"phase@{m.phase}@{m.phase_started_at}",
                    seen_at=m.phase_started_at + budget,
                )
            )
    return out


def collective_hangs(
    members: list[Signals], now: float, cfg: ProgressConfig
) -> list[ProgressFinding]:
    """Ranks report `collective_seq` (the collective they are in, or last finished) and the
    phase `collective` with its start; a rank behind the waiting ranks' seq is the laggard.
    A rank bound to the job in the registry whose beats do not (yet) say so is behind too:
    it was stopped before the monitor had a beat from it as a rank of the job."""
    out = []
    by_job: dict[str, list[Signals]] = {}
    for m in members:
        if m.role == "trainer" and "collective_seq" in m.counters:
            by_job.setdefault(m.job_id, []).append(m)
    for job_id, ranks in by_job.items():
        waiting = [
            r
            for r in ranks
            if r.phase == "collective" and now - r.phase_started_at > cfg.collective_budget
        ]
        if not waiting:
            continue
        seq = max(r.counters["collective_seq"] for r in waiting)
        behind = [r for r in ranks if r.counters["collective_seq"] < seq]
        unbeaten = [
            m
            for m in members
            if m.role == "trainer" and m.assigned_job == job_id and m not in ranks
        ]
        if not behind and not unbeaten:
            # Every rank is inside #seq: the one that stopped beating is stuck in it.
            behind = [
                r
                for r in ranks
                if r.last_beat_at is not None and now - r.last_beat_at >= cfg.silence_window
            ]
        waited = max(now - r.phase_started_at for r in waiting)
        others = sorted(r.rank for r in waiting if r not in behind)
        found = [(r, r.rank, _behind(r, seq)) for r in behind]
        found += [(m, m.assigned_rank, "has sent no beat as a rank of the job") for m in unbeaten]
        for laggard, rank, where in found:
            out.append(
                ProgressFinding(
                    "COLLECTIVE_HANG",
                    laggard.instance_id,
                    job_id,
                    rank,
                    f"ranks {others} have waited {waited:.1f}s in collective #{seq:.0f}; "
                    f"rank {rank} {where}",
                    0.9,
                    key=f"collective@{job_id}@{seq:.0f}",
                )
            )
    return out


def _behind(rank: Signals, seq: float) -> str:
    last = rank.counters["collective_seq"]
    if last < seq:
        return f"has not entered it (last #{last:.0f}, phase {rank.phase})"
    return "stopped beating inside it"


def nonfinite(members: list[Signals]) -> list[ProgressFinding]:
    """NaN/Inf counters above zero; each value is one episode (a counter that grew again is
    a new one)."""
    out = []
    for m in members:
        for name in NONFINITE_COUNTERS:
            value = m.counters.get(name, 0.0)
            if value > 0:
                where = name.removeprefix("nonfinite_")
                out.append(
                    ProgressFinding(
                        "NON_FINITE",
                        m.instance_id,
                        m.job_id,
                        m.rank,
                        f"non-finite {where} at step {m.counters.get('step', 0):.0f} "
                        f"on rank {m.rank}",
                        1.0,
                        key=f"{name}@{value}",
                        seen_at=m.last_beat_at,
                    )
                )
    return out


def degraded(members: list[Signals], cfg: ProgressConfig) -> list[ProgressFinding]:
    out = []
    by_job: dict[str, list[Signals]] = {}
    for m in members:
        if m.role == "rollout" and m.counters.get("requests_in_flight", 0.0) > 0:
            by_job.setdefault(m.job_id, []).append(m)
    for job_id, peers in by_job.items():
        if len(peers) < 3:
            continue  # a median of two says nothing about which one is slow
        median = statistics.median(p.counters.get("tokens_per_s", 0.0) for p in peers)
        for p in peers:
            rate = p.counters.get("tokens_per_s", 0.0)
            if median > 0 and rate < cfg.degraded_ratio * median:
                out.append(
                    ProgressFinding(
                        "DEGRADED",
                        p.instance_id,
                        job_id,
                        p.rank,
                        f"{rate:.0f} tokens/s against a peer median of {median:.0f}",
                        0.5,
                        key="degraded",
                    )
                )
    return out


def silent(members: list[Signals], now: float, cfg: ProgressConfig) -> list[ProgressFinding]:
    out = []
    for m in members:
        if m.last_beat_at is None:
            continue
        quiet = now - m.last_beat_at
        if quiet >= cfg.silence_window:
            out.append(
                ProgressFinding(
                    "SILENT",
                    m.instance_id,
                    m.job_id,
                    m.rank,
                    f"no heartbeat for {quiet:.1f}s on an open stream (last phase {m.phase})",
                    0.6,
                    key=f"silent@{m.last_beat_at}",
                )
            )
    return out


def evaluate(members: list[Signals], now: float, cfg: ProgressConfig) -> list[ProgressFinding]:
    """Every detector's findings not yet reported. Suspicions (`needs_probe`) come back every
    round until the monitor's probe settles them; `mark_reported` retires the others."""
    found = (
        silent(members, now, cfg)
        + rollout_hang_suspects(members, now, cfg)
        + trainer_hangs(members, now, cfg)
        + collective_hangs(members, now, cfg)
        + nonfinite(members)
        + degraded(members, cfg)
    )
    by_id = {m.instance_id: m for m in members}
    return [f for f in found if f.key not in by_id[f.instance_id].reported]


def mark_reported(member: Signals, finding: ProgressFinding) -> None:
    member.reported.add(finding.key)
