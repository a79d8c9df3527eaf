"""The server interceptor's log of failed calls: equal failures are logged once a window."""

from __future__ import annotations

from robustrl.core.interceptors import Repeats


def test_equal_failures_are_logged_once_a_window_and_the_next_says_how_many_were_not() -> None:
    now = [100.0]
    repeats = Repeats(10.0, clock=lambda: now[0])
    nospace = ("/Coordinator/LeaseWork", "UNAVAILABLE", "etcd is out of space")

    assert repeats.admit(nospace) == 0
    for _ in range(5):
        now[0] += 1
        assert repeats.admit(nospace) is None
    assert repeats.admit(("/Coordinator/LeaseWork", "UNAVAILABLE", "other reason")) == 0
    now[0] += 5  # 11 s after the one logged
    assert repeats.admit(nospace) == 5
    assert repeats.admit(nospace) is None
    now[0] += 60
    assert repeats.admit(nospace) == 1


def test_what_it_remembers_stays_bounded() -> None:
    now = [0.0]
    repeats = Repeats(1.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] += 0.01
        repeats.admit(("m", "UNAVAILABLE", f"reason {i}"))
    assert len(repeats._seen) <= 4096 + 1
