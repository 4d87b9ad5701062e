"""Replica health: a circuit breaker per replica, passive failure counting, retries with backoff.

Why a breaker: a dead or overloaded replica answers slowly or not at all; a router that keeps
sending it traffic turns one replica's trouble into every client's timeout. The breaker (Nygard,
"Release It!"; Envoy's outlier detection) has three states:

- **closed**: traffic flows; ``failure_threshold`` consecutive failures (connection refused,
  5xx, a failed ``/health`` probe) open it.
- **open**: no traffic for ``recovery_s``; then the next request attempt is let through as a
  trial, moving it to
- **half-open**: at most ``half_open_max`` trial requests in flight. A success closes the breaker
  (failure count reset); a failure opens it again for another ``recovery_s``.

Passive counting (what real requests saw) and active ``/health`` probes feed the same breaker,
so a replica that fails probes leaves rotation before a client has to find out.

Why retries need exponential backoff with *full jitter* (AWS Architecture Blog, "Exponential
Backoff and Jitter", 2015): when a replica blips, every client fails at the same moment; retrying
after a fixed delay brings them all back at the same moment again. ``delay = uniform(0,
min(cap, base * 2**attempt))`` spreads the retries over the whole window and still backs off
exponentially. Only failures before the first byte are retried here: after that the client has
seen output, and resuming is failover's job.

Everything takes an injected clock (``now()`` in seconds) and a seeded ``random.Random``, so the
tests drive it with a fake clock and get the same jitter every run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

Clock = Callable[[], float]


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, recovery_s: float = 5.0,
                 half_open_max: int = 1, clock: Clock = time.monotonic) -> None:
        if failure_threshold < 1 or half_open_max < 1:
            raise ValueError(f"failure_threshold and half_open_max must be >= 1, got "
                             f"{failure_threshold}, {half_open_max}")
        if recovery_s < 0:
            raise ValueError(f"recovery_s must be >= 0, got {recovery_s}")
        self.failure_threshold, self.recovery_s = failure_threshold, recovery_s
        self.half_open_max, self.clock = half_open_max, clock
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive, while closed
        self.opened_at: float | None = None
        self.trials = 0  # in flight while half-open
        self.transitions: list[tuple[float, str]] = []  # (time, new state): for timelines

    def _set(self, state: BreakerState) -> None:
        self.state = state
        self.transitions.append((self.clock(), state.value))

    def allow(self) -> bool:
        """May a request be sent now? In half-open this *reserves* a trial slot: call
        ``record_success`` or ``record_failure`` for every True answer."""
        if self.state is BreakerState.OPEN:
            if self.clock() - self.opened_at < self.recovery_s:
                return False
            self._set(BreakerState.HALF_OPEN)
            self.trials = 0
        if self.state is BreakerState.HALF_OPEN:
            if self.trials >= self.half_open_max:
                return False
            self.trials += 1
        return True

    @property
    def available(self) -> bool:
        """Would ``allow()`` say yes (without reserving anything)?"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self.clock() - self.opened_at >= self.recovery_s
        return self.trials < self.half_open_max

    def record_success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._set(BreakerState.CLOSED)
            self.trials = 0
        self.failures = 0

    def record_failure(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._open()
            return
        self.failures += 1
        if self.state is BreakerState.CLOSED and self.failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.opened_at = self.clock()
        self.failures = 0
        self.trials = 0
        self._set(BreakerState.OPEN)


class HealthTracker:
    """One breaker per replica name; the router asks it which replicas may take traffic."""

    def __init__(self, names: Sequence[str] = (), clock: Clock = time.monotonic,
                 **breaker_kw: Any) -> None:
        self.clock, self.breaker_kw = clock, breaker_kw
        self.breakers: dict[str, CircuitBreaker] = {}
        for n in names:
            self.add(n)

    def add(self, name: str) -> CircuitBreaker:
        if name not in self.breakers:
            self.breakers[name] = CircuitBreaker(clock=self.clock, **self.breaker_kw)
        return self.breakers[name]

    def remove(self, name: str) -> None:
        self.breakers.pop(name, None)

    def available(self, replicas: Sequence[Any]) -> list[Any]:
        """The replicas (objects with ``.name``) whose breaker would let a request through."""
        return [r for r in replicas if self.add(r.name).available]

    def record(self, name: str, ok: bool) -> None:
        """A request or ``/health`` probe outcome for ``name`` (passive or active check)."""
        b = self.add(name)
        b.record_success() if ok else b.record_failure()

    def probe(self, name: str, ok: bool) -> None:
        """An active ``/health`` probe outcome. A probe counts as a request: while a breaker is
        open and cooling down its result is ignored; once the cool-down is over the probe *is*
        the half-open trial, so a replica that came back closes its breaker without a client
        request having to risk it, and a dead one is re-opened without a client seeing it."""
        if self.add(name).allow():
            self.record(name, ok)

    def reset(self, name: str) -> None:
        """A fresh, closed breaker (an operator put the replica back after a restart)."""
        self.breakers[name] = CircuitBreaker(clock=self.clock, **self.breaker_kw)

    def states(self) -> dict[str, str]:
        return {n: b.state.value for n, b in self.breakers.items()}


class Backoff:
    """Exponential backoff with full jitter: attempt ``i`` (0-based) waits
    ``uniform(0, min(cap_s, base_s * 2**i))``; at most ``max_retries`` retries."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0, max_retries: int = 3,
                 rng: random.Random | None = None) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={base_s}, cap_s={cap_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_s, self.cap_s, self.max_retries = base_s, cap_s, max_retries
        self.rng = rng or random.Random(0)

    def ceiling(self, attempt: int) -> float:
        return min(self.cap_s, self.base_s * 2 ** attempt)

    def delay(self, attempt: int) -> float:
        return self.rng.uniform(0.0, self.ceiling(attempt))

    def delays(self) -> Iterator[float]:
        """The wait before each retry, ``max_retries`` of them."""
        for i in range(self.max_retries):
            yield self.delay(i)


class RetriesExhausted(RuntimeError):
    """Every attempt failed before the first byte; ``errors`` holds (replica, exception)."""

    def __init__(self, errors: list[tuple[str, BaseException]]) -> None:
        self.errors = errors
        tried = ", ".join(f"{n}: {type(e).__name__}: {e}" for n, e in errors)
        super().__init__(f"all {len(errors)} attempts failed before the first byte ({tried})")


def call_with_retries(attempt: Callable[[Any], Any], pick: Callable[[set[str]], Any],
                      tracker: HealthTracker, backoff: Backoff,
                      sleep: Callable[[float], None] = time.sleep,
                      retryable: tuple[type[BaseException], ...] = (ConnectionError,
                                                                    TimeoutError)) -> Any:
    """Run ``attempt(replica)`` on ``pick(excluded_names)``; on a retryable error record the
    failure, wait the next backoff delay and try another replica (the ones that failed are
    excluded while others remain). The synchronous twin of what the proxy does per request."""
    errors: list[tuple[str, BaseException]] = []
    delays = backoff.delays()
    while True:
        excluded = {n for n, _ in errors}
        replica = pick(excluded)
        try:
            result = attempt(replica)
        except retryable as exc:
            tracker.record(replica.name, False)
            errors.append((replica.name, exc))
            wait = next(delays, None)
            if wait is None:
                raise RetriesExhausted(errors) from exc
            sleep(wait)
            continue
        tracker.record(replica.name, True)
        return result
