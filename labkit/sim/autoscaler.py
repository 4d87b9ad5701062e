"""An autoscaler for the fleet simulator: how many replicas the load needs, and when to change.

The rule is Kubernetes' Horizontal Pod Autoscaler (and KServe/Knative's concurrency target):
every ``interval_s`` read a per-replica metric from the ready replicas and ask for

    desired = ceil(sum(metric) / target)          (= ceil(ready * mean / target))

clamped to ``[min_replicas, max_replicas]``. Metrics: ``outstanding`` (requests in a replica,
running + waiting: Knative's concurrency), ``waiting`` (its queue), ``kv`` (KV-cache usage,
0..1), or ``rps`` (requests per second routed to it over the last ``window_s``: Knative's RPS
target). Arrivals measure the load itself, linearly, and are the router's own count: they move
first. The other three respond to the load through the replica. ``waiting`` (and the TTFT it
sets) is a symptom of overload: near zero while the replica has free batch slots, it climbs only
once the batch is full, so it lags the arrivals and comes with the SLO breach, not before it
(the ``autoscale`` drill's step load in this simulator: arrivals cross capacity 0.85 s before
the first request misses a 0.25 s TTFT SLO, the queue reaches 4 within 0.5 s of that miss, and
the miss shows in measured TTFT later still). ``outstanding`` and ``kv`` rise with the load
sooner (in flight = rate x latency), but not linearly (latency grows with the batch), ``kv``
is capped by the pool and the batch limit, and past the knee ``outstanding`` grows without
bound with the queue, so the recommendation overshoots.
Three damping rules keep it from flapping, as the HPA's do:

- **tolerance**: within ``tolerance`` of the target (10%), keep the current count;
- **scale-down stabilization** (``cooldown_s``): scale down only to the *highest*
  recommendation of the last ``cooldown_s`` seconds, so a dip between two bursts does not
  release replicas that take ``cold_start`` seconds to come back;
- **scale-up cooldown** (``scale_up_cooldown_s``): at least this long between two scale-ups.

**Forecast** (``rps`` with a :class:`SeasonalForecast`): a replica asked for now serves only one
cold start later, so a purely reactive rule is always a cold start (plus half its window) behind
a rising load; it has to keep that much headroom all day, or miss the SLO on every morning ramp.
Daily traffic repeats, so deployments scale ahead of it (AWS predictive scaling; SageServe,
Jaiswal et al. 2025, forecasts LLM traffic for the same reason). The forecast here is
yesterday's *shape*: its per-bin arrival counts fitted by a few Fourier harmonics of the day,
which keeps the daily curve and smooths away yesterday's bursts and noise. Today's *level*
comes from the router's own count: the metric is

    rps = forecast(now + lead_s) * arrivals(last window_s) / forecast arrivals(last window_s)

so a day 20% busier than yesterday scales 20% higher, with no lag on the daily ramps (the
observed rate alone lags ``window_s / 2`` behind them, on the way up and down). A burst raises
the level for as long as the window holds it; that costs a replica for a while, and it is
headroom the fleet needs: a fleet sized exactly to the curve runs at its knee, so the queue a
burst leaves does not drain (with a median level, which ignores bursts, the earlier 240 s day met
the TTFT SLO for only 79% of requests at the same target). A ``window_s``
longer than a cold start keeps a burst that ends before a new replica could be up from
launching one (the queue has to absorb those anyway; launching for them only bills replicas that
arrive too late).

``current`` counts replicas still starting, so a cold start in progress is not launched twice.
Which replicas start or stop, and what a cold start costs, is the fleet's business
(``labkit.sim.fleet``); this class only answers "how many".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

METRICS = ("outstanding", "waiting", "kv", "rps")


@dataclass
class AutoscalerConfig:
    metric: str = "outstanding"
    target: float = 32.0
    min_replicas: int = 1
    max_replicas: int = 64
    interval_s: float = 1.0
    tolerance: float = 0.1
    cooldown_s: float = 30.0
    scale_up_cooldown_s: float = 0.0
    window_s: float = 10.0  # for rps: arrivals counted over this trailing window
    lead_s: float = 0.0  # for rps with a forecast: how far ahead to read it (a cold start)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown autoscaler metric {self.metric!r}; valid: {METRICS}")
        if not self.target > 0 or not self.interval_s > 0:
            raise ValueError(f"target and interval_s must be > 0, got {self.target}, "
                             f"{self.interval_s}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        if self.tolerance < 0 or self.cooldown_s < 0 or self.scale_up_cooldown_s < 0:
            raise ValueError("tolerance, cooldown_s and scale_up_cooldown_s must be >= 0")
        if not self.window_s > 0 or self.lead_s < 0:
            raise ValueError(f"window_s must be > 0 and lead_s >= 0, got {self.window_s}, "
                             f"{self.lead_s}")


class SeasonalForecast:
    """Arrivals per second at time ``t`` of the day, from yesterday's arrival times: the least
    squares fit of ``harmonics`` Fourier harmonics of the ``day_s`` period to yesterday's
    counts per ``bins`` equal slices of the day, median-smoothed over ``smooth`` slices
    (module doc, Forecast)."""

    def __init__(self, arrivals: Sequence[float], day_s: float, harmonics: int = 2,
                 bins: int = 96, smooth: int = 9) -> None:
        if not day_s > 0 or harmonics < 0 or bins < 2 * harmonics + 1 or \
                not 1 <= smooth <= bins or smooth % 2 == 0:
            raise ValueError(f"need day_s > 0, harmonics >= 0, bins >= 2 * harmonics + 1 and "
                             f"an odd smooth in [1, bins], got {day_s}, {harmonics}, {bins}, "
                             f"{smooth}")
        self.day_s, self.harmonics = day_s, harmonics
        edges = np.linspace(0.0, day_s, bins + 1)
        counts = np.histogram(np.asarray(arrivals, float) % day_s, edges)[0].astype(float)
        # a running median over `smooth` bins (the day wraps): a burst shorter than half of
        # it does not move the curve, as a fit of the raw counts would
        h = smooth // 2
        pad = np.concatenate([counts[bins - h:], counts, counts[:h]])
        counts = np.median(np.lib.stride_tricks.sliding_window_view(pad, smooth), axis=1)
        mid = (edges[:-1] + edges[1:]) / 2
        self.coef = np.linalg.lstsq(self._basis(mid), counts / (day_s / bins), rcond=None)[0]

    def _basis(self, t: np.ndarray) -> np.ndarray:
        w = 2 * np.pi * np.asarray(t, float)[:, None] / self.day_s
        k = np.arange(1, self.harmonics + 1)[None, :]
        return np.hstack([np.ones((len(w), 1)), np.cos(k * w), np.sin(k * w)])

    def rate(self, t: float) -> float:
        return max(0.0, float((self._basis(np.array([t])) @ self.coef)[0]))

    def level(self, t: float, arrivals: Sequence[float], window_s: float) -> float:
        """Today's level against yesterday: the arrivals of the last ``window_s`` before ``t``
        over the forecast's for the same span (1.0 before a second has passed). A plain ratio
        of counts, so a burst in the window raises it for as long as the window holds it: that
        is headroom, and the fleet needs it (module doc)."""
        span = min(window_s, t)
        if span < 1.0:
            return 1.0
        ts = t - span + span * (np.arange(32) + 0.5) / 32
        want = float(np.maximum(self._basis(ts) @ self.coef, 0.0).mean()) * span
        seen = sum(1 for x in arrivals if t - span <= x < t)
        return seen / want if want > 0 else 1.0

    def scaled(self, t: float, lead_s: float, arrivals: Sequence[float],
               window_s: float) -> float:
        """The rate ``lead_s`` after ``t``: yesterday's shape at today's level (module doc)."""
        return self.rate(t + lead_s) * self.level(t, arrivals, window_s)


class Autoscaler:
    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self._history: deque[tuple[float, int]] = deque()  # (time, raw recommendation)
        self._last_up: float | None = None

    def recommend(self, values: list[float], current: int) -> int:
        """The raw HPA recommendation from the ready replicas' metric values."""
        c = self.config
        if not values:
            return max(min(current, c.max_replicas), c.min_replicas)
        total = float(sum(values))
        if abs(total / len(values) / c.target - 1.0) <= c.tolerance:
            raw = current
        else:
            raw = math.ceil(total / c.target - 1e-9)
        return max(min(raw, c.max_replicas), c.min_replicas)

    def desired(self, now: float, values: list[float], current: int) -> int:
        """How many replicas (ready + starting) the fleet should have after this tick."""
        c = self.config
        raw = self.recommend(values, current)
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - c.cooldown_s:
            self._history.popleft()
        if raw > current:
            if self._last_up is not None and now - self._last_up < c.scale_up_cooldown_s:
                return current
            self._last_up = now
            return raw
        if raw < current:
            return min(current, max(r for _, r in self._history))
        return current
