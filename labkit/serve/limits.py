"""API keys with tenants, and per-key token buckets on requests/s and tokens/s.

Keys are compared with ``hmac.compare_digest`` against *every* configured key (no early exit):
a plain ``==`` stops at the first differing byte, so response times would leak how much of a
guessed key is right.

A token bucket holds up to ``burst`` tokens and refills at ``rate`` per second; a request takes
``cost`` (1 for the request bucket, prompt + max_tokens for the token bucket, so a caller cannot
dodge the limit by asking for many tokens in few requests). When the bucket is short, the answer
is 429 with ``Retry-After`` = the seconds until it holds ``cost`` again, and nothing is taken, so
a refused request does not drain the bucket further.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class TokenBucket:
    """``try_take(cost)`` -> 0.0 if taken, else the seconds to wait (nothing taken)."""

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not math.isfinite(rate):
            raise ValueError(f"token bucket rate must be a positive number, got {rate!r}")
        burst = rate if burst is None else burst
        if not burst >= 1:  # a bucket that can never hold one request refuses everything
            raise ValueError(f"token bucket burst must be >= 1, got {burst!r}")
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens = self.burst
        self.last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def try_take(self, cost: float = 1.0) -> float:
        self._refill()
        if cost > self.burst:  # could never succeed: say so instead of a Retry-After loop
            return math.inf
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate

    def give_back(self, cost: float) -> None:
        """Undo a take (the request was refused by a later check)."""
        self.tokens = min(self.burst, self.tokens + cost)


@dataclass
class KeyLimits:
    requests: TokenBucket | None
    tokens: TokenBucket | None

    def check(self, cost_tokens: int) -> float:
        """0.0 if admitted (both buckets charged), else the Retry-After seconds."""
        wait = self.requests.try_take(1) if self.requests else 0.0
        if wait:
            return wait
        wait = self.tokens.try_take(cost_tokens) if self.tokens else 0.0
        if wait and self.requests:
            self.requests.give_back(1)
        return wait


def parse_api_keys(specs: Iterable[str]) -> dict[str, str]:
    """``KEY`` or ``KEY:TENANT`` -> {key: tenant} (the tenant defaults to the key's index)."""
    keys: dict[str, str] = {}
    for i, spec in enumerate(specs):
        key, _, tenant = spec.partition(":")
        if not key:
            raise ValueError(f"--api-key {spec!r}: the key is empty")
        keys[key] = tenant or f"key{i}"
    return keys


class Authenticator:
    """Maps a request's ``Authorization: Bearer KEY`` to its tenant, in constant time."""

    def __init__(self, keys: dict[str, str], rps: float | None = None,
                 tps: float | None = None, burst_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, bucket: Any = None) -> None:
        self.keys = [(k.encode(), t) for k, t in keys.items()]
        self.limits: dict[str, KeyLimits] = {}
        self.rps, self.tps, self.burst_s, self.clock = rps, tps, burst_s, clock
        self.bucket = bucket or TokenBucket  # the class: an exercise swaps in its own

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a valid key, else None. Every key is compared (no early exit)."""
        if not self.keys:
            return "default"
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        found = None
        for key, tenant in self.keys:
            if hmac.compare_digest(key, given):
                found = tenant
        return found

    def limit(self, tenant: str, cost_tokens: int) -> float:
        """0.0 to admit, else Retry-After seconds (inf: larger than the bucket ever holds)."""
        if self.rps is None and self.tps is None:
            return 0.0
        lim = self.limits.get(tenant)
        if lim is None:
            mk = lambda r: self.bucket(r, max(1.0, r * self.burst_s), self.clock) if r else None
            lim = self.limits[tenant] = KeyLimits(mk(self.rps), mk(self.tps))
        return lim.check(cost_tokens)
