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
    nonfinite_reported: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ProgressFinding:
    kind: str  # ROLLOUT_HANG_SUSPECT, TRAINER_HANG, COLLECTIVE_HANG, NON_FINITE, DEGRADED
    instance_id: str
    job_id: str
    rank: int
    evidence: str
    confidence: float


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
    in_flight = counters.get("requests_in_flight", 0.0)
    if (
        counters.get("tokens_generated", 0.0) > before
        or in_flight == 0
        or signals.tokens_changed_at is None
    ):
        # New tokens, or nothing asked of it: the hang clock starts over.
        signals.tokens_changed_at = now
    signals.phase, signals.phase_started_at = phase, phase_started_at
    signals.counters = dict(counters)


def rollout_hang_suspects(
    members: list[Signals], now: float, cfg: ProgressConfig
) -> list[ProgressFinding]:
    out = []
    for m in members:
        if m.role != "rollout" or m.counters.get("requests_in_flight", 0.0) <= 0:
            continue
        if m.tokens_changed_at is None:
            continue
        silent = now - m.tokens_changed_at
        if silent >= cfg.rollout_hang_window:
            out.append(
                ProgressFinding(
                    "ROLLOUT_HANG_SUSPECT",
                    m.instance_id,
                    m.job_id,
                    m.rank,
                    f"no new tokens for {silent:.1f}s with "
                    f"{m.counters['requests_in_flight']:.0f} requests in flight",
                    0.6,
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
                )
            )
    return out


def collective_hangs(
    members: list[Signals], now: float, cfg: ProgressConfig
) -> list[ProgressFinding]:
    """Ranks report `collective_seq` (the collective they are in, or last finished) and the
    phase `collective` with its start; a rank behind the waiting ranks' seq is the laggard."""
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
        for laggard in ranks:
            if laggard.counters["collective_seq"] < seq:
                waited = max(now - r.phase_started_at for r in waiting)
                out.append(
                    ProgressFinding(
                        "COLLECTIVE_HANG",
                        laggard.instance_id,
                        job_id,
                        laggard.rank,
                        f"ranks {sorted(r.rank for r in waiting)} have waited {waited:.0f}s in "
                        f"collective #{seq:.0f}; rank {laggard.rank} has not entered it "
                        f"(last #{laggard.counters['collective_seq']:.0f}, phase {laggard.phase})",
                        0.9,
                    )
                )
    return out


def nonfinite(members: list[Signals]) -> list[ProgressFinding]:
    """NaN/Inf counters that grew since last reported. Marks them reported (mutates)."""
    out = []
    for m in members:
        for name in NONFINITE_COUNTERS:
            value = m.counters.get(name, 0.0)
            if value > m.nonfinite_reported.get(name, 0.0):
                m.nonfinite_reported[name] = value
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
                    )
                )
    return out
