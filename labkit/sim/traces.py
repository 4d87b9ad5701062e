"""Multi-tenant traces for the fleet simulator: who sends what, and when.

A fleet sees many tenants, each with its own system prompt (an app, an agent, a customer's
instructions) repeated at the start of every request it sends; a few tenants send most of the
traffic (Zipf popularity). That repetition is what prefix-affinity routing turns into cache hits.

Arrivals are a Poisson process whose rate may vary in time: constant (``poisson``), or a
**bursty day** (``bursty_day``): a diurnal curve (raised cosine, trough at 04:00 and peak at
16:00 of the day) times short bursts (a launch, a retry storm) on top. Requests are drawn from the
non-homogeneous process by thinning (Lewis and Shedler, 1979): candidates at the peak rate, each
kept with probability rate(t) / peak.

Where the shape comes from: Azure's public LLM inference trace of May 2024 (a week of two
production services, the data of DynamoLLM, Stojkovic et al., HPCA 2025; plotted per minute in
``analysis/AzureLLMInferenceDataset2024.ipynb`` of Azure/AzurePublicDataset) has one broad
daily peak; read off those plots, the weekday trough is ~40% of the peak for conversation
(~1,900 vs ~4,500 requests/minute) and ~10% for coding (~500 vs ~5,000). The default trough of
20% (a 5:1 day) lies between the two.

A simulated day is *compressed* into ``day_s`` seconds; only the slow curve is: each request
still takes its real time on the simulated GPUs, cold starts and the autoscaler's windows are
real seconds, and so should a burst be (``burst_s``: a retry storm does not last longer
because the day is simulated slower; ``labkit bench cluster`` gives 5 s; the default, 2% of
the day, scales with it). A compressed day is harder for
an autoscaler than a real one: the load ramps faster relative to the cold start.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from labkit.sim.workloads import LengthDist, RequestSpec


@dataclass(frozen=True)
class Tenant:
    system_len: int  # tokens of its system prompt, a multiple of 16 (whole KV blocks)
    share: float  # fraction of the traffic it sends


def make_tenants(num: int, seed: int = 0, zipf_s: float = 1.0, system_min: int = 256,
                 system_max: int = 2048) -> list[Tenant]:
    """``num`` tenants with Zipf(``zipf_s``) traffic shares and system prompts uniform in
    [system_min, system_max] rounded to whole 16-token blocks."""
    if num < 1 or not 16 <= system_min <= system_max:
        raise ValueError(f"need num >= 1 and 16 <= system_min <= system_max, got {num}, "
                         f"{system_min}, {system_max}")
    rng = np.random.default_rng([3, seed])
    w = 1.0 / np.arange(1, num + 1) ** zipf_s
    w /= w.sum()
    lens = rng.integers(system_min // 16, system_max // 16 + 1, num) * 16
    return [Tenant(int(n), float(s)) for n, s in zip(lens, w)]


def diurnal(day_s: float, peak_rate: float, trough_frac: float = 0.2) -> Callable[[float], float]:
    """rate(t): a raised cosine from ``trough_frac * peak_rate`` at 04:00 to ``peak_rate`` at
    16:00, with the 24 hours compressed into ``day_s`` seconds."""
    if not 0 < trough_frac <= 1:
        raise ValueError(f"trough_frac must be in (0, 1], got {trough_frac}")
    lo = trough_frac * peak_rate

    def rate(t: float) -> float:
        hour = 24.0 * t / day_s
        return lo + (peak_rate - lo) * 0.5 * (1 - math.cos(2 * math.pi * (hour - 4) / 24))

    return rate


@dataclass(frozen=True)
class Burst:
    start: float
    duration: float
    factor: float  # rate multiplier while it lasts


def with_bursts(rate: Callable[[float], float], bursts: list[Burst]) -> Callable[[float], float]:
    def bursty(t: float) -> float:
        f = 1.0
        for b in bursts:
            if b.start <= t < b.start + b.duration:
                f *= b.factor
        return rate(t) * f

    return bursty


def thinning(rate: Callable[[float], float], rate_max: float, duration: float,
             rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process with intensity ``rate(t) <= rate_max`` on
    [0, duration) (Lewis-Shedler thinning)."""
    if rate_max <= 0 or duration <= 0:
        raise ValueError(f"rate_max and duration must be > 0, got {rate_max}, {duration}")
    n = rng.poisson(rate_max * duration)
    cand = np.sort(rng.uniform(0.0, duration, n))
    rates = np.array([rate(t) for t in cand])
    if np.any(rates > rate_max * (1 + 1e-9)):
        raise ValueError("rate(t) exceeds rate_max: thinning would under-sample")
    return cand[rng.uniform(0.0, rate_max, n) < rates]


@dataclass
class Trace:
    specs: list[RequestSpec]
    duration: float
    rate: Callable[[float], float]
    meta: dict[str, Any] = field(default_factory=dict)


def multi_tenant_requests(arrivals: np.ndarray, tenants: list[Tenant], seed: int = 0,
                          user_mean: float = 150, output_mean: float = 200,
                          sigma: float = 0.8, max_len: int = 1024) -> list[RequestSpec]:
    """One request per arrival: a tenant by share, its system prompt, then a lognormal user part
    and output (``sigma`` spread, clipped to [1, max_len])."""
    rng = np.random.default_rng([4, seed])
    n = len(arrivals)
    who = rng.choice(len(tenants), n, p=[t.share for t in tenants])
    user = LengthDist.fit(user_mean, sigma, 1, max_len).sample(rng, n)
    out = LengthDist.fit(output_mean, sigma, 1, max_len).sample(rng, n)
    return [RequestSpec(tenants[g].system_len + int(u), int(o), float(t),
                        prefix_group=int(g) + 1000 * seed, prefix_len=tenants[g].system_len,
                        seed=seed * 1_000_003 + i)
            for i, (g, u, o, t) in enumerate(zip(who, user, out, arrivals))]


def poisson_trace(rate: float, duration: float, num_tenants: int = 32, seed: int = 0,
                  **kw: Any) -> Trace:
    """Constant-rate Poisson arrivals from ``num_tenants`` Zipf tenants."""
    rng = np.random.default_rng([5, seed])
    arrivals = thinning(lambda t: rate, rate, duration, rng)
    specs = multi_tenant_requests(arrivals, make_tenants(num_tenants, seed), seed, **kw)
    return Trace(specs, duration, lambda t: rate, {"kind": "poisson", "rate": rate,
                                                   "num_tenants": num_tenants, "seed": seed})


def bursty_day(day_s: float, peak_rate: float, trough_frac: float = 0.2,
               num_bursts: int = 4, burst_factor: float = 1.5, burst_s: float | None = None,
               num_tenants: int = 32, seed: int = 0, busy: tuple[float, float] = (0.45, 0.9),
               **kw: Any) -> Trace:
    """A compressed day: diurnal rate times ``num_bursts`` bursts of ``burst_factor`` lasting
    ``burst_s`` (default 2% of the day) at random times in the busy part of the day
    (``busy`` = (0.45, 0.9) of it, where the diurnal rate is above ~65% of the peak), one in
    each of ``num_bursts`` equal slices of it so that two bursts never stack."""
    rng = np.random.default_rng([6, seed])
    burst_s = 0.02 * day_s if burst_s is None else burst_s
    seg = (busy[1] - busy[0]) * day_s / max(num_bursts, 1)  # one burst per segment: no overlap
    if num_bursts and burst_s > seg:
        raise ValueError(f"{num_bursts} bursts of {burst_s} s do not fit apart in the busy "
                         f"part of the day ({seg * num_bursts:.0f} s)")
    starts = busy[0] * day_s + seg * np.arange(num_bursts) + rng.uniform(0, seg - burst_s,
                                                                           num_bursts)
    bursts = [Burst(float(s), burst_s, burst_factor) for s in starts]
    rate = with_bursts(diurnal(day_s, peak_rate, trough_frac), bursts)
    rate_max = peak_rate * max(burst_factor, 1.0)
    arrivals = thinning(rate, rate_max, day_s, rng)
    specs = multi_tenant_requests(arrivals, make_tenants(num_tenants, seed), seed, **kw)
    meta = {"kind": "bursty-day", "day_s": day_s, "peak_rate": peak_rate,
            "trough_frac": trough_frac, "bursts": [vars(b) for b in bursts], "busy": busy,
            "num_tenants": num_tenants, "seed": seed}
    return Trace(specs, day_s, rate, meta)
