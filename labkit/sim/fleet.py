"""The fleet simulator: many replicas, each the real engine over the simulator, behind a router
policy, optionally resized by an autoscaler.

Every replica is an ``LLMEngine`` (the real scheduler, block manager and prefix cache) over a
``CoarseSimExecutor`` on its own virtual clock (``labkit.sim.coarse``). The fleet replays a trace
in arrival order. Before each arrival at time t it steps every replica until its clock reaches t
(an engine step is atomic, so a replica mid-step finishes that step first: the new request waits
for it, as it would on a GPU), so the router sees each replica's real in-flight count at t; then
the policy picks a replica. The policy is any object with ``choose(key, replicas)``: in practice
the router's own classes (``labkit.router.policies``), passed in by the caller because the
simulator sits below the router in the layering.

With an autoscaler (``labkit.sim.autoscaler``), every ``interval_s`` the fleet reads the metric
from the ready replicas (for ``rps``, the router's arrival count, or a ``forecast`` of the
rate ``lead_s`` ahead at today's level when one is given) and starts or drains replicas. A
started replica is billed from launch but takes traffic only after its cold start
(``labkit.sim.presets.cold_start_s``); a drained one leaves rotation at once and is billed
until its last request finishes. Every fleet is billed from the start of the trace to its end
(``duration``), a replica for the part of it that it was up: a trace is one day of a day that
repeats, so the requests still running at midnight are served by the next day's replicas, on
the next day's bill (billing them up to the last finish would charge one fleet a tail that a
static fleet, billed replicas x day, is not charged).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.engine.llm_engine import LLMEngine
from labkit.sim.autoscaler import Autoscaler, SeasonalForecast
from labkit.sim.coarse import add_coarse_request, coarse_engine
from labkit.sim.workloads import RequestSpec


@dataclass
class FleetConfig:
    """One replica's engine (sizes in real tokens) and the coarse-token scale of the fleet."""

    model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    token_scale: int = 8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None


@dataclass(frozen=True)
class FleetKey:
    """What the router would see of a request (the shape of ``labkit.router.policies.RouteKey``,
    which the simulator may not import): the prompt's real token ids."""

    token_ids: Sequence[int]
    text: str | None = None
    user: str | None = None


class SimReplica:
    def __init__(self, name: str, engine: LLMEngine, launched_at: float, ready_at: float) -> None:
        self.name, self.engine = name, engine
        self.launched_at, self.ready_at = launched_at, ready_at
        self.stopped_at: float | None = None
        self.draining = False
        self.outstanding = 0  # the router's count: routed and not finished

    def advance(self, t: float) -> None:
        """Step the engine until its clock reaches ``t`` or it runs out of work."""
        eng = self.engine
        while eng.scheduler.has_unfinished() and eng.clock.now() < t:
            for o in eng.step():
                if o.finished:
                    self.outstanding -= 1
        if self.draining and self.outstanding == 0 and self.stopped_at is None:
            self.stopped_at = max(eng.clock.now(), self.ready_at)

    def metric(self, kind: str) -> float:
        if kind == "outstanding":
            return float(self.outstanding)
        if kind == "waiting":
            return float(self.engine.scheduler.num_waiting + len(self.engine.scheduler.pending))
        pool = self.engine.block_manager.pool  # blocks held by requests (not idle cached ones)
        return pool.num_used / pool.num_blocks


@dataclass
class FleetResult:
    requests: list[dict[str, Any]]
    replicas: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    end: float  # billing horizon: the end of the trace
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_seconds(self) -> float:
        return sum(r["stopped_at"] - r["launched_at"] for r in self.replicas)

    def ttfts(self) -> np.ndarray:
        return np.array([r["ttft"] for r in self.requests], dtype=float)

    def slo_attainment(self, ttft_slo_s: float) -> float:
        """Fraction of requests whose first token came within ``ttft_slo_s``."""
        t = self.ttfts()
        return float(np.mean(t <= ttft_slo_s)) if len(t) else 1.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried prompt tokens, over every replica."""
        q = sum(r["prefix_query_tokens"] for r in self.replicas)
        return sum(r["prefix_hit_tokens"] for r in self.replicas) / max(q, 1)

    def summary(self, ttft_slo_s: float | None = None) -> dict[str, Any]:
        t = self.ttfts()
        s = {"requests": len(t), "replica_hours": self.replica_seconds / 3600,
             "max_replicas": max((p["ready"] + p["starting"] for p in self.timeline),
                                 default=len(self.replicas)),
             "hit_rate": self.hit_rate, "ttft_p50": float(np.percentile(t, 50)),
             "ttft_p99": float(np.percentile(t, 99)), **self.meta}
        if ttft_slo_s is not None:
            s["slo_attainment"] = self.slo_attainment(ttft_slo_s)
        return s


class Fleet:
    def __init__(self, policy: Any, num_replicas: int, config: FleetConfig | None = None,
                 autoscaler: Autoscaler | None = None, cold_start_s: float = 0.0,
                 interval_s: float | None = None,
                 forecast: SeasonalForecast | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if cold_start_s < 0:
            raise ValueError(f"cold_start_s must be >= 0, got {cold_start_s}")
        self.policy, self.config, self.autoscaler = policy, config or FleetConfig(), autoscaler
        self.cold_start_s, self.forecast = cold_start_s, forecast
        self.interval_s = interval_s or (autoscaler.config.interval_s if autoscaler else 1.0)
        self.replicas: list[SimReplica] = []
        self.timeline: list[dict[str, Any]] = []
        self._arrivals: deque[float] = deque()  # for the rps metric
        for _ in range(num_replicas):
            self._launch(0.0, ready_at=0.0)

    def _launch(self, now: float, ready_at: float) -> SimReplica:
        c = self.config
        eng = coarse_engine(c.model, c.gpu, c.token_scale, max_num_seqs=c.max_num_seqs,
                            max_num_batched_tokens=c.max_num_batched_tokens,
                            max_model_len=c.max_model_len, kv_cache_bytes=c.kv_cache_bytes,
                            enable_prefix_caching=c.enable_prefix_caching, start=ready_at)
        r = SimReplica(f"replica-{len(self.replicas)}", eng, now, ready_at)
        self.replicas.append(r)
        return r

    def _live(self) -> list[SimReplica]:
        return [r for r in self.replicas if not r.draining]

    def routable(self, now: float) -> list[SimReplica]:
        return [r for r in self.replicas if not r.draining and r.ready_at <= now]

    def _advance_all(self, t: float) -> None:
        for r in self.replicas:
            if r.stopped_at is None and r.ready_at <= t:
                r.advance(t)

    def _tick(self, now: float) -> None:
        self._advance_all(now)
        ready = self.routable(now)
        live = self._live()
        a = self.autoscaler
        metric = a.config.metric if a else "outstanding"
        if metric == "rps":  # the router's arrival count, shared evenly over the ready replicas
            while self._arrivals and self._arrivals[0] < now - a.config.window_s:
                self._arrivals.popleft()
            rps = len(self._arrivals) / min(a.config.window_s, max(now, self.interval_s))
            if self.forecast is not None:  # ahead of the day, at today's level
                rps = self.forecast.scaled(now, a.config.lead_s, self._arrivals,
                                           a.config.window_s)
            values = [rps / len(ready)] * len(ready)
        else:
            values = [r.metric(metric) for r in ready]
        desired = a.desired(now, values, len(live)) if a else len(live)
        for _ in range(desired - len(live)):
            self._launch(now, now + self.cold_start_s)
        if desired < len(live):  # starting ones first (nothing to drain), then the least busy
            victims = sorted(live, key=lambda r: (r.ready_at <= now, r.outstanding))
            for r in victims[: len(live) - desired]:
                r.draining = True
                if r.ready_at > now or r.outstanding == 0:
                    r.stopped_at = now
        self.timeline.append({"t": now, "ready": len(ready), "desired": desired,
                              "starting": sum(r.ready_at > now for r in self._live()),
                              "metric": float(np.mean(values)) if values else 0.0,
                              "outstanding": sum(r.outstanding for r in ready)})

    def run(self, specs: list[RequestSpec], duration: float | None = None,
            progress: bool = False) -> FleetResult:
        """Replay ``specs`` (sorted by arrival); bill every replica up to ``duration``."""
        specs = sorted(specs, key=lambda s: s.arrival_time)
        end = max(duration or 0.0, specs[-1].arrival_time if specs else 0.0)
        vocab = self.replicas[0].engine.vocab_size
        next_tick = 0.0
        for i, spec in enumerate(tqdm(specs, desc="fleet", disable=not progress, leave=False)):
            t = spec.arrival_time
            while next_tick <= t:
                self._tick(next_tick)
                next_tick += self.interval_s
            self._advance_all(t)
            ids = spec.prompt_token_ids(vocab)
            r = self.policy.choose(FleetKey(ids), self.routable(t))
            rid = f"r{i}"
            add_coarse_request(r.engine, rid, spec, t, ids)
            r.outstanding += 1
            self._arrivals.append(t)
        while next_tick <= end:
            self._tick(next_tick)
            next_tick += self.interval_s
        self._advance_all(float("inf"))
        return self._result(end)

    def _result(self, end: float) -> FleetResult:
        reqs, reps = [], []
        for r in self.replicas:
            early = r.engine.executor.first_token_early
            for t in r.engine.request_timings():
                ttft = t["first_token_time"] - t["arrival_time"] - early.get(t["seq_id"], 0.0)
                reqs.append({"request_id": t["request_id"], "replica": r.name,
                             "arrival": t["arrival_time"], "ttft": ttft,
                             "e2e": t["finish_time"] - t["arrival_time"]})
        for r in self.replicas:
            s = r.engine.block_manager.stats()
            reps.append({"name": r.name, "launched_at": r.launched_at, "ready_at": r.ready_at,
                         "stopped_at": min(end, end if r.stopped_at is None else r.stopped_at),
                         "prefix_query_tokens": s["prefix_query_tokens"],
                         "prefix_hit_tokens": s["prefix_hit_tokens"],
                         "num_requests": len(r.engine.requests)})
        reqs.sort(key=lambda x: x["arrival"])
        return FleetResult(reqs, reps, self.timeline, end,
                           {"policy": getattr(self.policy, "name", type(self.policy).__name__),
                            "token_scale": self.config.token_scale})
