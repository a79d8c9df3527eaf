"""ETTR (effective training time ratio) accounting — pure: every time comes from the caller.

Effective time is the measure of the union of
  - the intervals in which the trainer made a step that is kept (not rolled back later). A
    step's interval runs from the end of its previous step (or from when the trainer became
    ready after a start or a restore) to its end, so the usual wait for data between steps
    counts as part of making the step. A wait longer than usual does not: the interval counted
    is at most STALL_FACTOR times the job's typical step interval (the TYPICAL_QUANTILE of
    the last RECENT_STEPS), and never less than the step's own work. Without that bound, the time a
    trainer spends waiting for restarted rollouts after a full restart would count as
    progress. The first step of a job has no typical interval yet and counts its work only;
  - the intervals in which a rollout generated a group that was later trained (used),
within the job's wall time [started_at, now or ended_at]. A union, not a sum: rollouts and
the trainer overlap, and counting both would let ETTR pass 1. Generation that is used counts
even while the trainer restarts, which is what role-based recovery is for: the job still
makes progress that is kept.

Size stays bounded for long jobs by `compact`: everything before a horizon is folded into a
running total (`folded_s`). That is exact as long as nothing changes before the horizon
afterwards, which holds because
  - a roll back only ever removes steps after the last durable checkpoint, so step intervals
    up to `checkpoint_step` can be folded (`compact` never folds past the start of a later
    step, and `roll_back` refuses to undo a step that was folded);
  - a generation interval is reported once its group trains, so the caller puts the horizon
    no later than the earliest generation still out (`fold_horizon`: groups delivered and not
    trained, groups on a lease). An interval that still reaches back before the horizon
    counts from the horizon on: the total can only be under-, never over-counted.
Used generation intervals are merged as they arrive (they are never taken back), so between
compactions they stay as few as the gaps between them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from pydantic import BaseModel, Field

STALL_FACTOR = 2.0
"""A step's counted interval is at most this many typical step intervals (see the module doc)."""
RECENT_STEPS = 31
"""How many of the latest step intervals the typical interval is taken from."""
TYPICAL_QUANTILE = 0.9
"""Which of the recent intervals is the typical one: the 90th percentile, not the median. A
pipelined job's intervals can alternate between short (the next batch was ready) and long (it
was not), and twice the median would cut every long wait (decision 0013). A few waits for
restarted roles among the recent intervals still leave the typical one alone."""
FOLD_AFTER_S = 600.0
"""Seconds after which a job's account folds its history whatever is still out (an interval
that arrives later still counts from the horizon on: an undercount, never an overcount)."""
MAX_INCIDENTS = 200
"""Incident timings kept in an account; older ones leave the list (counted in incidents_total)."""


class Span(BaseModel):
    start: float
    end: float


class StepSpan(Span):
    step: int


class IncidentTiming(BaseModel):
    """One incident's timeline: when the failure happened (if known), when the monitor
    reported it, and when the job was running again."""

    incident_id: str
    kind: str
    role: str
    instance_id: str
    failed_at: float | None = None
    """When the fault happened, where someone knows it (chaos injection); None otherwise."""
    detected_at: float
    recovered_at: float | None = None
    """None while the recovery is under way (or was never needed)."""

    @property
    def detection_s(self) -> float | None:
        return None if self.failed_at is None else self.detected_at - self.failed_at

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.detected_at


class EttrAccount(BaseModel):
    """Stored in etcd as compressed JSON (`packed`), so a new coordinator leader carries on."""

    started_at: float
    ended_at: float | None = None
    steps: list[StepSpan] = Field(default_factory=list)
    """Kept step intervals after the horizon, in arrival order (a step may appear twice)."""
    generations: list[Span] = Field(default_factory=list)
    """Used generation intervals after the horizon: sorted, disjoint, merged on arrival."""
    horizon: float | None = None
    """Everything before this time is in folded_s; None: nothing folded yet (started_at)."""
    folded_s: float = 0.0
    folded_through_step: int = 0
    """The highest step with time folded into folded_s: a roll back below it is refused."""
    rolled_back_steps: int = 0
    rolled_back_s: float = 0.0
    """Trainer seconds spent on steps that a roll back threw away (a plain sum)."""
    incidents: list[IncidentTiming] = Field(default_factory=list)
    incidents_total: int = 0
    recent_intervals: list[float] = Field(default_factory=list)
    """The latest RECENT_STEPS step intervals as reported (end - start), oldest first."""
    stalled_s: float = 0.0
    """Seconds of waiting beyond the bound that steps did not count (a plain sum)."""

    # ------------------------------------------------------------------ recording

    def add_step(
        self, step: int, start: float, end: float, work_start: float | None = None
    ) -> None:
        """The trainer made `step` between `start` (its previous step's end, or when it became
        ready) and `end`, working on it from `work_start` (the batch was complete; None: the
        whole interval was work). Kept unless rolled back later; see the module doc for the
        bound on the wait."""
        start, end = self._span(start, end)
        work_start = start if work_start is None else min(max(work_start, start), end)
        typical = _quantile(self.recent_intervals, TYPICAL_QUANTILE)
        self.recent_intervals = [*self.recent_intervals, end - start][-RECENT_STEPS:]
        counted_from = min(work_start, max(start, end - STALL_FACTOR * typical))
        self.stalled_s += counted_from - start
        if end > counted_from:
            self.steps.append(StepSpan(step=step, start=counted_from, end=end))

    def roll_back(self, to_step: int) -> None:
        """A restore from the checkpoint of `to_step`: the steps after it stop counting."""
        if to_step < self.folded_through_step:
            raise ValueError(
                f"cannot roll back to step {to_step}: steps through {self.folded_through_step} "
                "were compacted (compact only what a checkpoint has made durable)"
            )
        lost = [s for s in self.steps if s.step > to_step]
        self.steps = [s for s in self.steps if s.step <= to_step]
        self.rolled_back_steps += len({s.step for s in lost})
        self.rolled_back_s += sum(s.end - s.start for s in lost)

    def add_generation(self, start: float, end: float) -> None:
        """A rollout generated, during [start, end], a group that was then trained."""
        start, end = self._span(start, end)
        if end <= start:
            return
        gens = self.generations
        # Merge with every interval it touches; the list stays sorted and disjoint. Searched
        # by key, not over lists of every end and start built per call: that was O(n) per
        # trained group, minutes of the leader's CPU over an account of thousands of spans.
        lo = bisect.bisect_left(gens, start, key=lambda g: g.end)
        hi = bisect.bisect_right(gens, end, key=lambda g: g.start)
        if lo < hi:
            start = min(start, gens[lo].start)
            end = max(end, gens[hi - 1].end)
        gens[lo:hi] = [Span(start=start, end=end)]

    def end(self, at: float) -> None:
        self.ended_at = at

    def add_incident(self, timing: IncidentTiming) -> None:
        """Record an incident (or update the one with the same id); keeps the newest ones."""
        for i, known in enumerate(self.incidents):
            if known.incident_id == timing.incident_id:
                self.incidents[i] = timing
                return
        self.incidents.append(timing)
        self.incidents_total += 1
        del self.incidents[:-MAX_INCIDENTS]

    def recovered(self, incident_id: str, at: float) -> None:
        """The job runs again after `incident_id`; an incident no longer kept is ignored."""
        for i, known in enumerate(self.incidents):
            if known.incident_id == incident_id and known.recovered_at is None:
                self.incidents[i] = known.model_copy(update={"recovered_at": at})

    # ------------------------------------------------------------------ reading

    def effective(self, now: float) -> float:
        """Seconds of kept progress within [started_at, now or ended_at]."""
        until = self._until(now)
        return self.folded_s + union_length(self._spans(), self._horizon(), until)

    def wall(self, now: float) -> float:
        return max(0.0, self._until(now) - self.started_at)

    def ettr(self, now: float) -> float:
        """effective / wall; 0.0 before any wall time has passed."""
        wall = self.wall(now)
        return self.effective(now) / wall if wall > 0 else 0.0

    def summary(self, now: float) -> dict[str, object]:
        """What `robustrl status` and the run summary show."""
        return {
            "ettr": self.ettr(now),
            "effective_s": self.effective(now),
            "wall_s": self.wall(now),
            "rolled_back_steps": self.rolled_back_steps,
            "rolled_back_s": self.rolled_back_s,
            "stalled_s": self.stalled_s,
            "incidents_total": self.incidents_total,
            "incidents": [
                {**i.model_dump(), "detection_s": i.detection_s, "recovery_s": i.recovery_s}
                for i in self.incidents
            ],
        }

    # ------------------------------------------------------------------ compaction

    def compact(self, before: float, checkpoint_step: int | None = None) -> None:
        """Fold everything before `before` into folded_s, keeping the numbers identical.

        `checkpoint_step`: the last durable checkpoint. Steps after it may still be rolled
        back, so the horizon stops at the start of the earliest of them. The caller puts
        `before` far enough back that no used generation interval will still arrive that
        starts earlier (the staleness window). Without `checkpoint_step`, the caller promises
        that no step with time before `before` will be rolled back; `roll_back` checks it.
        """
        horizon = self._until(before)
        if checkpoint_step is not None:
            for s in self.steps:
                if s.step > checkpoint_step:
                    horizon = min(horizon, s.start)
        if horizon <= self._horizon():
            return
        self.folded_s += union_length(self._spans(), self._horizon(), horizon)
        touched = [s.step for s in self.steps if s.start < horizon]
        self.folded_through_step = max([self.folded_through_step, *touched])
        self.steps = [
            s.model_copy(update={"start": max(s.start, horizon)})
            for s in self.steps
            if s.end > horizon
        ]
        self.generations = [
            Span(start=max(g.start, horizon), end=g.end)
            for g in self.generations
            if g.end > horizon
        ]
        self.horizon = horizon

    # ------------------------------------------------------------------ internals

    def _horizon(self) -> float:
        return self.started_at if self.horizon is None else self.horizon

    def _until(self, now: float) -> float:
        return now if self.ended_at is None else min(now, self.ended_at)

    def _span(self, start: float, end: float) -> tuple[float, float]:
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"not an interval: [{start}, {end}]")
        # Time before the horizon is already folded; counting it again could double it.
        return max(start, self._horizon()), end

    def _spans(self) -> Iterable[Span]:
        yield from self.steps
        yield from self.generations


def fold_horizon(
    now: float,
    pending_generation_starts: Iterable[float],
    lease_deadlines: Iterable[float],
    lease_seconds: float,
) -> float:
    """How far back an account may be compacted (`compact`'s `before`) so that no used
    generation interval can still arrive that starts earlier: the earliest start among the
    delivered groups not trained yet and among the groups out on a lease (generated after
    they were leased, at `deadline - lease_seconds`), but never more than FOLD_AFTER_S back.

    A fixed FOLD_AFTER_S alone would let a fast job's account hold every step of its last ten
    minutes, rewritten to etcd on every step (decision 0006).
    """
    earliest = min([now, *pending_generation_starts, *(d - lease_seconds for d in lease_deadlines)])
    return max(now - FOLD_AFTER_S, earliest)


def union_length(spans: Iterable[Span], lo: float, hi: float) -> float:
    """The measure of the union of `spans` clipped to [lo, hi]."""
    clipped = sorted(
        (max(s.start, lo), min(s.end, hi)) for s in spans if s.end > lo and s.start < hi
    )
    total = 0.0
    run_start, run_end = lo, lo
    for start, end in clipped:
        if start > run_end:  # a gap: close the run so far
            total += run_end - run_start
            run_start = start
        run_end = max(run_end, end)
    return total + run_end - run_start


def _quantile(values: list[float], q: float) -> float:
    """The value at quantile `q` of `values` (one of them, the lower at a tie); 0 if none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]
