"""An autoscaler for the fleet simulator: how many replicas the load needs, and when to change.

The rule is Kubernetes' Horizontal Pod Autoscaler (and KServe/Knative's concurrency target):
every ``interval_s`` read a per-replica metric from the ready replicas and ask for

    desired = ceil(sum(metric) / target)          (= ceil(ready * mean / target))

clamped to ``[min_replicas, max_replicas]``. Metrics: ``outstanding`` (requests in a replica,
running + waiting: Knative's concurrency), ``waiting`` (its queue), ``kv`` (KV-cache usage,
0..1), or ``rps`` (requests per second routed to it over the last ``window_s``: Knative's RPS
target). The first three are symptoms: they grow only once a replica is busy, and past its knee
the queue grows without bound, so the recommendation overshoots. Arrivals measure the load
itself, linearly, and are the router's own count.
Three damping rules keep it from flapping, as the HPA's do:

- **tolerance**: within ``tolerance`` of the target (10%), keep the current count;
- **scale-down stabilization** (``cooldown_s``): scale down only to the *highest*
  recommendation of the last ``cooldown_s`` seconds, so a dip between two bursts does not
  release replicas that take ``cold_start`` seconds to come back;
- **scale-up cooldown** (``scale_up_cooldown_s``): at least this long between two scale-ups.

``current`` counts replicas still starting, so a cold start in progress is not launched twice.
Which replicas start or stop, and what a cold start costs, is the fleet's business
(``labkit.sim.fleet``); this class only answers "how many".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

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
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


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
