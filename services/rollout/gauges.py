"""A rollout's gauges, which the monitor reads in its beats, and the probe it answers when a
rollout looks hung. `GenerationMeter` keeps them:
- `tokens_generated`: tokens sampled by this process, counted after every decode step from
  the generation thread, so a long generation keeps it growing;
- `requests_in_flight`: prompts inside the engine now; 0 while leasing, waiting for weights,
  scoring or delivering (none of that is generation, so none of it can be a generation hang);
- `weight_updates_in_flight`: 1 while a weight version is being loaded into the engine (an engine
  in a process of its own can hang there as in a generation), else 0;
- `oldest_request_age_s`: seconds the oldest of them has been in the engine (0 when none);
- `tokens_per_s`: tokens over the last `RATE_WINDOW_S` seconds;
- `nonfinite_logprobs`: NaN/Inf logprobs of sampled tokens seen by this process. A group with
  one is never sent to the trainer and is not completed: its lease runs out and the
  coordinator leases it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from robustrl.core.heartbeat import Progress
from robustrl.weights import WeightTransport

RATE_WINDOW_S = 5.0
"""Span of the recent token rate (`tokens_per_s`)."""

GAUGE_INTERVAL_S = 0.25
"""How often the gauges that change with time alone (request age, token rate) and the weight
transport's (a pull's progress, what was relayed) are refreshed: a hung generation thread cannot
refresh them."""


@dataclass(frozen=True)
class ProbeResult:
    progressing: bool
    requests_in_flight: int
    tokens_generated: float
    detail: str


class GenerationMeter:
    """The rollout's progress counters (see the module docstring) and the probe over them.

    `on_tokens` runs on the generation thread; everything else on the event loop. Every key
    exists before the thread writes, so a beat copying the counters never sees the dict
    change size; a float store is atomic under the GIL. The cumulative counters carry on
    from what this process already reported, so they never go down when a new job binds.
    """

    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters
        for name in ("tokens_generated", "nonfinite_logprobs"):
            counters.setdefault(name, 0.0)
        gauges = ("requests_in_flight", "weight_updates_in_flight", "oldest_request_age_s")
        for name in (*gauges, "tokens_per_s"):
            counters[name] = 0.0
        self.tokens = counters["tokens_generated"]
        self.nonfinite = counters["nonfinite_logprobs"]
        self.in_flight = 0
        self.in_flight_since = 0.0
        self.updating_since: float | None = None
        self._samples: deque[tuple[float, float]] = deque()
        self._wakers: list[Callable[[], None]] = []

    @property
    def probes_waiting(self) -> int:
        return len(self._wakers)

    def on_tokens(self, count: int) -> None:
        """The engine sampled `count` new tokens (generation thread)."""
        self.tokens += count
        self.counters["tokens_generated"] = self.tokens
        self._wake()

    def _wake(self) -> None:
        for wake in tuple(self._wakers):
            wake()

    @contextlib.contextmanager
    def generating(self, requests: int) -> Iterator[None]:
        """`requests` prompts are inside the engine for the duration."""
        self.in_flight, self.in_flight_since = requests, time.monotonic()
        self.counters["requests_in_flight"] = float(requests)
        try:
            yield
        finally:
            self.in_flight = 0
            self.counters["requests_in_flight"] = 0.0
            self.counters["oldest_request_age_s"] = 0.0
            self._wake()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """A weight version is being loaded into the engine for the duration: work that must
        finish, as a generation must make tokens (the probe waits for its end)."""
        self.updating_since = time.monotonic()
        self.counters["weight_updates_in_flight"] = 1.0
        try:
            yield
        finally:
            self.updating_since = None
            self.counters["weight_updates_in_flight"] = 0.0
            self._wake()

    def count_nonfinite(self, count: int) -> None:
        self.nonfinite += count
        self.counters["nonfinite_logprobs"] = self.nonfinite

    def refresh(self, now: float) -> None:
        """Update the time-driven gauges (`now`: time.monotonic())."""
        self.counters["oldest_request_age_s"] = (
            max(now - self.in_flight_since, 0.0) if self.in_flight else 0.0
        )
        samples = self._samples
        samples.append((now, self.tokens))
        while len(samples) > 1 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        then, tokens_then = samples[0]
        self.counters["tokens_per_s"] = (
            (self.tokens - tokens_then) / (now - then) if now > then else 0.0
        )

    async def probe(self, wait_s: float) -> ProbeResult:
        """Progressing unless the engine has work (requests in flight, or a weight update) and
        neither a token comes nor the work ends within `wait_s`."""
        if self.in_flight == 0 and self.updating_since is None:
            return ProbeResult(True, 0, self.tokens, "idle: no requests in flight")
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under a late thread
                loop.call_soon_threadsafe(woken.set)

        before, in_flight, started = self.tokens, self.in_flight, time.monotonic()
        update = self.updating_since

        def ended() -> bool:
            return self.in_flight == 0 if in_flight else self.updating_since != update

        self._wakers.append(wake)
        try:
            while True:
                # Cleared before the check: a token counted after the check sets it again.
                woken.clear()
                remaining = started + wait_s - time.monotonic()
                if self.tokens > before or ended() or remaining <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), remaining)
        finally:
            self._wakers.remove(wake)
        took = time.monotonic() - started
        if self.tokens > before:
            return ProbeResult(
                True,
                self.in_flight,
                self.tokens,
                f"{self.tokens - before:.0f} new tokens in {took:.2f}s "
                f"with {in_flight} requests in flight",
            )
        if ended():
            what = "generation" if in_flight else "weight update"
            return ProbeResult(True, self.in_flight, self.tokens, f"the {what} in flight finished")
        if not in_flight and update is not None:
            return ProbeResult(
                False,
                0,
                self.tokens,
                f"a weight update in the engine unfinished after "
                f"{time.monotonic() - update:.1f}s ({self.tokens:.0f} tokens generated before)",
            )
        return ProbeResult(
            False,
            self.in_flight,
            self.tokens,
            f"no new token in {took:.1f}s with {self.in_flight} requests in flight for "
            f"{time.monotonic() - self.in_flight_since:.1f}s "
            f"({self.tokens:.0f} tokens generated before)",
        )


async def keep_gauges_fresh(
    meter: GenerationMeter, progress: Progress, transport: Callable[[], WeightTransport | None]
) -> None:
    """Every GAUGE_INTERVAL_S, on the event loop: the meter's time-driven gauges, and the
    weight transport's once there is one (`transport()`)."""
    while True:
        meter.refresh(time.monotonic())
        current = transport()
        if current is not None:  # how far a pull has come, what was relayed
            # In place, on the loop (the beats are copied there), not by set_counter: the
            # meter keeps this dict and writes into it from the generation thread.
            progress.counters.update(current.gauges())
        await asyncio.sleep(GAUGE_INTERVAL_S)
