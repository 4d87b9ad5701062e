"""Circuit breaker, health tracker and backoff, driven by a fake clock and a seeded RNG."""

import random
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from labkit.router.health import (
    Backoff,
    BreakerState,
    CircuitBreaker,
    HealthTracker,
    RetriesExhausted,
    call_with_retries,
)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@dataclass
class R:
    name: str
    outstanding: int = 0


def test_breaker_closed_open_half_open_closed():
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=3, recovery_s=5.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success resets the consecutive count
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow() and not b.available
    clock.t += 4.99
    assert not b.allow()
    clock.t += 0.01
    assert b.available and b.allow()  # the trial request
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow() and not b.available  # only one trial in flight
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()
    assert [s for _, s in b.transitions] == ["open", "half-open", "closed"]
    assert [t for t, _ in b.transitions] == [100.0, 105.0, 105.0]


def test_failed_trial_reopens_for_another_recovery_period():
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, recovery_s=2.0, clock=clock)
    b.record_failure()
    clock.t += 2.0
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and b.opened_at == clock.t
    clock.t += 1.0
    assert not b.allow()
    clock.t += 1.0
    assert b.allow()


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=1.0, cap_s=0.5)


def test_tracker_takes_failing_replicas_out_of_rotation_and_back():
    clock = FakeClock()
    t = HealthTracker(["a", "b"], clock=clock, failure_threshold=2, recovery_s=1.0)
    rs = [R("a"), R("b"), R("c")]
    t.record("b", False)
    assert [r.name for r in t.available(rs)] == ["a", "b", "c"]
    t.record("b", False)  # a second failed probe: b leaves rotation
    assert [r.name for r in t.available(rs)] == ["a", "c"]
    assert t.states()["b"] == "open"
    clock.t += 1.0
    assert [r.name for r in t.available(rs)] == ["a", "b", "c"]


def test_probes_are_trials_while_open_and_reset_closes():
    clock = FakeClock()
    t = HealthTracker(["a"], clock=clock, failure_threshold=2, recovery_s=1.0)
    t.probe("a", False)
    t.probe("a", False)
    assert t.states()["a"] == "open"
    t.probe("a", True)  # still cooling down: a probe's success is not a trial yet
    assert t.states()["a"] == "open"
    clock.t += 1.0
    t.probe("a", False)  # the trial failed: open for another recovery period
    assert t.states()["a"] == "open" and t.breakers["a"].opened_at == clock.t
    clock.t += 1.0
    t.probe("a", True)  # the replica came back: the probe's trial closes the breaker
    assert t.states()["a"] == "closed"
    t.probe("a", False)
    t.probe("a", False)
    t.reset("a")
    assert t.states()["a"] == "closed" and t.breakers["a"].failures == 0


def test_full_jitter_bounds_seeding_and_distribution():
    b = Backoff(base_s=0.1, cap_s=1.0, max_retries=6, rng=random.Random(7))
    assert [b.ceiling(i) for i in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    d1 = list(b.delays())
    assert d1 == list(Backoff(0.1, 1.0, 6, random.Random(7)).delays())
    assert all(0 <= d <= b.ceiling(i) for i, d in enumerate(d1))
    # full jitter: delay / ceiling is uniform on [0, 1] (Kolmogorov-Smirnov test)
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(1))
    u = np.array([b.delay(i % 6) / b.ceiling(i % 6) for i in range(3000)])
    assert stats.kstest(u, "uniform").pvalue > 1e-3


def test_retries_move_to_another_replica_with_the_backoff_delays():
    clock = FakeClock()
    tracker = HealthTracker(clock=clock, failure_threshold=1, recovery_s=10)
    rs = [R("a"), R("b"), R("c")]
    slept = []
    calls = []

    def pick(excluded):
        return [r for r in tracker.available(rs) if r.name not in excluded][0]

    def attempt(r):
        calls.append(r.name)
        if r.name != "c":
            raise ConnectionError(f"{r.name} refused")
        return "ok"

    backoff = Backoff(0.1, 1.0, 3, random.Random(3))
    expected = list(Backoff(0.1, 1.0, 3, random.Random(3)).delays())[:2]
    assert call_with_retries(attempt, pick, tracker, backoff, sleep=slept.append) == "ok"
    assert calls == ["a", "b", "c"] and slept == expected
    assert tracker.states() == {"a": "open", "b": "open", "c": "closed"}


def test_retries_give_up_after_max_retries():
    tracker = HealthTracker(failure_threshold=100)

    def attempt(r):
        raise TimeoutError("slow")

    with pytest.raises(RetriesExhausted, match="all 3 attempts failed"):
        call_with_retries(attempt, lambda ex: R("a"), tracker, Backoff(max_retries=2),
                          sleep=lambda s: None)

    def bug(r):  # not a transport error: no retry, the error surfaces as itself
        raise KeyError("bug")

    with pytest.raises(KeyError):
        call_with_retries(bug, lambda ex: R("a"), tracker, Backoff(), sleep=lambda s: None)
