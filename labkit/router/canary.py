"""Canary release: send a share of traffic to a candidate, compare it with the baseline, roll back.

A new model build (a quantized export, a new engine flag) can pass every offline test and still
be slower or fail more on live traffic. A canary gives it a small share first and watches the two
sets side by side, as Flagger and Argo Rollouts do:

- **Selection** (:class:`CanarySplit`): a header forces an arm (``x-labkit-canary: candidate`` or
  ``baseline``: for testing a build by hand); else a request with an OpenAI ``user`` goes by a
  sticky hash of it (a user sees one build for the whole conversation, not a mix), else by a
  seeded weighted coin.
- **Analysis** (:class:`CanaryAnalysis`): each arm keeps a sliding window of its last ``window``
  outcomes (ok?, TTFT). Every ``interval`` candidate outcomes, once both arms have
  ``min_samples``, one check compares candidate against baseline: error rate more than
  ``max_error_increase`` above the baseline's, or TTFT p99 more than ``max_ttft_p99_ratio`` times
  the baseline's, fails it. ``threshold`` consecutive failed checks roll the candidate back
  (weight 0). One failed check is not enough because p99 of a few hundred samples is noisy: with
  TTFT lognormal (sigma 0.5), the log p99 of a 400-sample window has a standard error of ~0.09,
  so two identical builds differ by more than 1.5x (0.405 in log) only at ~3 sigma.

Comparing with the live baseline (not fixed numbers) is what makes the verdict robust to a load
spike: both arms see it. Nothing here does I/O: the router feeds outcomes in and reads the verdict.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BASELINE, CANDIDATE = "baseline", "candidate"
CANARY_HEADER = "x-labkit-canary"


def _unit_hash(text: str) -> float:
    """A stable hash of ``text`` onto [0, 1): the same user falls on the same side every time,
    in every process (no PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") / 2**64


class CanarySplit:
    def __init__(self, weight: float = 0.1, header: str = CANARY_HEADER,
                 rng: random.Random | None = None) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"canary weight must be in [0, 1], got {weight}")
        self.weight, self.header = weight, header.lower()
        self.rng = rng or random.Random(0)

    def assign(self, user: str | None = None, headers: Mapping[str, str] | None = None) -> str:
        """``baseline`` or ``candidate`` for one request."""
        if headers:
            forced = {k.lower(): v for k, v in headers.items()}.get(self.header)
            if forced is not None:
                forced = forced.strip().lower()
                if forced not in (BASELINE, CANDIDATE):
                    raise ValueError(f"header {self.header}: {forced!r} is not "
                                     f"'{BASELINE}' or '{CANDIDATE}'")
                return forced
        if user:
            return CANDIDATE if _unit_hash(user) < self.weight else BASELINE
        return CANDIDATE if self.rng.random() < self.weight else BASELINE


@dataclass
class Verdict:
    action: str  # "wait" (too few samples), "pass", "fail" (one failed check), "rollback"
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)


class CanaryAnalysis:
    def __init__(self, window: int = 400, min_samples: int = 100, interval: int = 25,
                 threshold: int = 2, max_error_increase: float = 0.05,
                 max_ttft_p99_ratio: float = 1.5) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        if interval < 1 or threshold < 1:
            raise ValueError(f"interval and threshold must be >= 1, got {interval}, {threshold}")
        self.window, self.min_samples = window, min_samples
        self.interval, self.threshold = interval, threshold
        self.max_error_increase, self.max_ttft_p99_ratio = max_error_increase, max_ttft_p99_ratio
        self.arms: dict[str, deque] = {a: deque(maxlen=window) for a in (BASELINE, CANDIDATE)}
        self.seen = {BASELINE: 0, CANDIDATE: 0}
        self.failed_checks = 0
        self.rolled_back_after: int | None = None  # candidate requests seen at rollback
        self.checks: list[Verdict] = []

    @property
    def rolled_back(self) -> bool:
        return self.rolled_back_after is not None

    def record(self, arm: str, ok: bool, ttft_s: float | None = None) -> Verdict | None:
        """One finished request; returns the verdict when a check ran."""
        if arm not in self.arms:
            raise ValueError(f"arm must be '{BASELINE}' or '{CANDIDATE}', got {arm!r}")
        self.arms[arm].append((bool(ok), ttft_s))
        self.seen[arm] += 1
        if arm != CANDIDATE or self.rolled_back or self.seen[CANDIDATE] % self.interval:
            return None
        v = self.check()
        self.checks.append(v)
        return v

    @staticmethod
    def summary(samples: deque) -> dict[str, float | None]:
        ttft = [t for ok, t in samples if ok and t is not None]
        return {"n": len(samples), "error_rate": 1 - sum(ok for ok, _ in samples) / len(samples),
                "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None}

    def check(self) -> Verdict:
        if min(len(s) for s in self.arms.values()) < self.min_samples:
            return Verdict("wait", f"fewer than {self.min_samples} samples in an arm")
        b, c = self.summary(self.arms[BASELINE]), self.summary(self.arms[CANDIDATE])
        m = {"baseline": b, "candidate": c}
        reasons = []
        if c["error_rate"] - b["error_rate"] > self.max_error_increase:
            reasons.append(f"error rate {c['error_rate']:.3f} vs baseline {b['error_rate']:.3f}")
        if c["ttft_p99"] is not None and b["ttft_p99"] is not None and \
                c["ttft_p99"] > self.max_ttft_p99_ratio * b["ttft_p99"]:
            reasons.append(f"TTFT p99 {c['ttft_p99']:.3f}s vs baseline {b['ttft_p99']:.3f}s")
        if not reasons:
            self.failed_checks = 0
            return Verdict("pass", "", m)
        self.failed_checks += 1
        if self.failed_checks < self.threshold:
            return Verdict("fail", "; ".join(reasons), m)
        self.rolled_back_after = self.seen[CANDIDATE]
        return Verdict("rollback", "; ".join(reasons), m)


class Canary:
    """Split + analysis: a rollback sets the candidate's weight to 0 (headers still force)."""

    def __init__(self, split: CanarySplit | None = None,
                 analysis: CanaryAnalysis | None = None) -> None:
        self.split = split or CanarySplit()
        self.analysis = analysis or CanaryAnalysis()

    def assign(self, user: str | None = None, headers: Mapping[str, str] | None = None) -> str:
        return self.split.assign(user, headers)

    def record(self, arm: str, ok: bool, ttft_s: float | None = None) -> Verdict | None:
        v = self.analysis.record(arm, ok, ttft_s)
        if v is not None and v.action == "rollback":
            self.split.weight = 0.0
        return v
