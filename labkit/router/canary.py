"""Canary release: send a share of traffic to a candidate, compare it with the baseline, roll back.

A new model build (a quantized export, a new engine flag) can pass every offline test and still
be slower or fail more on live traffic. A canary gives it a small share first and watches the two
sets side by side, as Flagger and Argo Rollouts do:

- **Selection** (:class:`CanarySplit`): a header forces an arm (``x-labkit-canary: 1`` or
  ``candidate``, ``0`` or ``baseline``: for testing a build by hand); else a request with an
  OpenAI ``user`` goes by a sticky hash of it (a user sees one build for the whole conversation,
  not a mix), else by a seeded weighted coin.
- **Analysis** (:class:`CanaryAnalysis`): each arm keeps a sliding window of its last ``window``
  outcomes (ok?, TTFT). Every ``interval`` candidate outcomes, once both arms have
  ``min_samples``, one check compares candidate against baseline (:func:`judge`): error rate more
  than ``max_error_increase`` above the baseline's, or TTFT p99 more than ``max_ttft_p99_ratio``
  times the baseline's, fails it. ``threshold`` consecutive failed checks roll the candidate back
  (weight 0). One failed check is not enough because p99 of a few hundred samples is noisy: with
  TTFT lognormal (sigma 0.5), the log p99 of a 400-sample window has a standard error of ~0.09,
  so two identical builds differ by more than 1.5x (0.405 in log) only at ~3 sigma.
- **In the router** (:class:`Canary`): ``pick`` gives the request's arm and the replica set to
  route it in (the routing policy then chooses inside that set, retries stay inside it, so a
  failing candidate is charged its failures); ``watch`` wraps the response body to time the
  first byte (TTFT for a stream, the whole answer otherwise: both arms are measured alike) and
  see whether it finished; the outcome goes to the analysis and to Prometheus counters by arm,
  which is what the PromQL analysis (``labkit.router.prometheus``) reads instead when a
  Prometheus scrapes the router.

Comparing with the live baseline (not fixed numbers) is what makes the verdict robust to a load
spike: both arms see it. Nothing here does network I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BASELINE, CANDIDATE = "baseline", "candidate"
CANARY_HEADER = "x-labkit-canary"
_FORCE = {"1": CANDIDATE, "true": CANDIDATE, CANDIDATE: CANDIDATE,
          "0": BASELINE, "false": BASELINE, BASELINE: BASELINE}
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
log = logging.getLogger("labkit.router.canary")


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
                arm = _FORCE.get(forced.strip().lower())
                if arm is None:
                    raise ValueError(f"header {self.header}: {forced!r} is not "
                                     f"'{BASELINE}' or '{CANDIDATE}' (or 0 / 1)")
                return arm
        if user:
            return CANDIDATE if _unit_hash(user) < self.weight else BASELINE
        return CANDIDATE if self.rng.random() < self.weight else BASELINE


@dataclass
class Verdict:
    action: str  # "wait" (too few samples), "pass", "fail" (one failed check), "rollback"
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    source: str = "router"  # where the numbers came from: the router's counters or PromQL
    at: float = field(default_factory=time.time)
    candidate_seen: int = 0  # candidate requests finished when the check ran


def judge(b: Mapping[str, Any], c: Mapping[str, Any], max_error_increase: float,
          max_ttft_p99_ratio: float) -> list[str]:
    """Why candidate summary ``c`` is worse than baseline ``b`` (empty: it is not). A summary is
    ``{"error_rate": float, "ttft_p99": float | None}``; a missing p99 is not compared."""
    reasons = []
    if c["error_rate"] - b["error_rate"] > max_error_increase:
        reasons.append(f"error rate {c['error_rate']:.3f} vs baseline {b['error_rate']:.3f}")
    if c["ttft_p99"] is not None and b["ttft_p99"] is not None and \
            c["ttft_p99"] > max_ttft_p99_ratio * b["ttft_p99"]:
        reasons.append(f"TTFT p99 {c['ttft_p99']:.3f}s vs baseline {b['ttft_p99']:.3f}s")
    return reasons


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
        self.auto = True  # False: the PromQL loop runs the checks instead of record()

    @property
    def rolled_back(self) -> bool:
        return self.rolled_back_after is not None

    def record(self, arm: str, ok: bool, ttft_s: float | None = None) -> Verdict | None:
        """One finished request; returns the verdict when a check ran."""
        if arm not in self.arms:
            raise ValueError(f"arm must be '{BASELINE}' or '{CANDIDATE}', got {arm!r}")
        self.arms[arm].append((bool(ok), ttft_s))
        self.seen[arm] += 1
        if not self.auto or arm != CANDIDATE or self.rolled_back or \
                self.seen[CANDIDATE] % self.interval:
            return None
        return self.check()

    @staticmethod
    def summary(samples: deque) -> dict[str, float | None]:
        ttft = [t for ok, t in samples if ok and t is not None]
        return {"n": len(samples), "error_rate": 1 - sum(ok for ok, _ in samples) / len(samples),
                "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None}

    def check(self) -> Verdict:
        """One check on the router's own windows."""
        if min(len(s) for s in self.arms.values()) < self.min_samples:
            return self.decide(None, None)
        return self.decide(self.summary(self.arms[BASELINE]), self.summary(self.arms[CANDIDATE]))

    def decide(self, b: Mapping[str, Any] | None, c: Mapping[str, Any] | None,
               source: str = "router") -> Verdict:
        """Apply the thresholds to two arm summaries (from any source) and count consecutive
        failures; ``None`` or an arm under ``min_samples`` requests waits."""
        if b is None or c is None or min(b["n"], c["n"]) < self.min_samples:
            v = Verdict("wait", f"fewer than {self.min_samples} samples in an arm",
                        {"baseline": b, "candidate": c}, source)
        elif not (reasons := judge(b, c, self.max_error_increase, self.max_ttft_p99_ratio)):
            self.failed_checks = 0
            v = Verdict("pass", "", {"baseline": b, "candidate": c}, source)
        else:
            self.failed_checks += 1
            action = "fail" if self.failed_checks < self.threshold else "rollback"
            if action == "rollback":
                self.rolled_back_after = self.seen[CANDIDATE]
            v = Verdict(action, "; ".join(reasons), {"baseline": b, "candidate": c}, source)
        v.candidate_seen = self.seen[CANDIDATE]
        self.checks.append(v)
        return v


class _ArmMetrics:
    """Per-arm Prometheus series on the router's registry, shaped like Istio's (requests by
    outcome, a latency histogram), which is what Flagger's PromQL templates read."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("labkit_router_canary_requests", "requests finished, by arm "
                                "and status (ok, error)", ["arm", "status"], registry=registry)
        self.ttft = Histogram("labkit_router_canary_ttft_seconds", "router-side time to the "
                              "first response byte, by arm", ["arm"], buckets=TTFT_BUCKETS,
                              registry=registry)
        self.weight = Gauge("labkit_router_canary_weight", "share of traffic the candidate gets",
                            registry=registry)
        self.rolled_back = Gauge("labkit_router_canary_rolled_back", "1 after an automatic "
                                 "rollback", registry=registry)


class Canary:
    """Split + analysis, wired into the router: a rollback sets the candidate's weight to 0,
    sends all traffic to the baseline (header-forced requests too) and records why."""

    def __init__(self, split: CanarySplit | None = None,
                 analysis: CanaryAnalysis | None = None, promql: Any = None,
                 interval_s: float = 5.0) -> None:
        self.split = split or CanarySplit()
        self.analysis = analysis or CanaryAnalysis()
        # promql: an object with ``async summaries() -> (baseline, candidate)`` read from
        # Prometheus (labkit.router.prometheus.PromQLCanarySource); then the checks run on a
        # clock, every ``interval_s``, as Flagger's analysis does, not per request
        self.promql, self.interval_s = promql, interval_s
        if promql is not None:
            self.analysis.auto = False
        self.initial_weight = self.split.weight
        self.rollback_reason: str | None = None
        self.events: deque = deque(maxlen=10_000)  # the last finished requests: timelines
        self.metrics: _ArmMetrics | None = None
        self._t0 = time.monotonic()

    def assign(self, user: str | None = None, headers: Mapping[str, str] | None = None) -> str:
        return self.split.assign(user, headers)

    def record(self, arm: str, ok: bool, ttft_s: float | None = None) -> Verdict | None:
        self.events.append({"t": time.monotonic() - self._t0, "arm": arm, "ok": bool(ok),
                            "ttft": ttft_s})
        if self.metrics is not None:
            self.metrics.requests.labels(arm, "ok" if ok else "error").inc()
            if ok and ttft_s is not None:
                self.metrics.ttft.labels(arm).observe(ttft_s)
        v = self.analysis.record(arm, ok, ttft_s)
        if v is not None:
            self.apply(v)
        return v

    def apply(self, v: Verdict) -> None:
        """Act on a verdict (from the router's counters or from PromQL)."""
        if v.action != "rollback" or self.rollback_reason is not None:
            return
        self.split.weight = 0.0
        self.rollback_reason = f"{v.reason} (source: {v.source})"
        log.warning("canary rolled back after %s candidate requests: %s",
                    self.analysis.rolled_back_after, self.rollback_reason)
        if self.metrics is not None:
            self.metrics.weight.set(0.0)
            self.metrics.rolled_back.set(1)

    # --- the router's hooks -------------------------------------------------------------
    def attach(self, registry: Any) -> None:
        """Export the per-arm series on the router's ``/metrics``."""
        self.metrics = _ArmMetrics(registry)
        self.metrics.weight.set(self.split.weight)

    def pick(self, user: str | None, headers: Mapping[str, str], stable: Sequence[Any],
             candidates: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        """The request's arm and the replica set to route it in: after a rollback, always the
        baseline (a header no longer reaches the rolled-back build). Raises ValueError on a bad
        header value (the router answers 400)."""
        arm = self.assign(user, headers)
        if self.rollback_reason is not None:
            arm = BASELINE
        return arm, (candidates if arm == CANDIDATE else stable)

    async def watch(self, body: AsyncIterator[bytes], arm: str, t0: float,
                    status: int) -> AsyncIterator[bytes]:
        """Relay ``body`` unchanged, timing its first byte from ``t0`` (``time.monotonic``);
        record the outcome when it ends. A client that leaves is nobody's error: not recorded."""
        ttft, finished = None, False
        try:
            async for chunk in body:
                if ttft is None:
                    ttft = time.monotonic() - t0
                yield chunk
            finished = True
        except Exception:
            self.record(arm, False, None)
            raise
        finally:
            if finished:
                self.record(arm, status < 500, ttft)

    async def promql_loop(self) -> None:
        """Every ``interval_s``: both arms' numbers from Prometheus, one decision. Where
        Prometheus does not answer (not installed, not scraped yet), the same check runs on the
        router's own windows, and the verdict says so."""
        while not self.analysis.rolled_back:
            await asyncio.sleep(self.interval_s)
            try:
                b, c = await self.promql.summaries()
                v = self.analysis.decide(b, c, source="prometheus")
            except Exception as exc:  # noqa: BLE001 - any failure to read means: fall back
                v = self.analysis.check()
                v.source = f"router (prometheus failed: {type(exc).__name__}: {exc})"
            self.apply(v)

    def status(self) -> dict[str, Any]:
        """What ``GET /canary`` answers."""
        a = self.analysis
        return {"weight": self.split.weight, "initial_weight": self.initial_weight,
                "rolled_back": a.rolled_back, "rolled_back_after": a.rolled_back_after,
                "reason": self.rollback_reason, "seen": dict(a.seen),
                "checks": [{"action": v.action, "reason": v.reason, "source": v.source,
                            "metrics": v.metrics, "at": v.at} for v in a.checks[-20:]]}

