"""``labkit bench cluster``: routing policies and autoscaling for a fleet, in the simulator.

Two experiments, every replica the engine's real scheduler, block manager and prefix cache over
the roofline simulator (``labkit.sim.fleet``, coarse tokens: ``labkit.sim.coarse``), routed by the
router's own policy classes (``labkit.router.policies``):

1. **Prefix-affinity vs round-robin at 4..64 replicas**: one multi-tenant Poisson trace (Zipf
   tenants, each with its own system prompt) spread over N replicas. Round-robin makes every
   replica prefill every tenant's system prompt; prefix-affinity sends a tenant to the replica
   that has it cached (bounded load keeps hot tenants from melting one replica). Reported: the
   fleet's prefix hit rate (hit tokens / prompt tokens) and TTFT p50/p99.
2. **Autoscaling a bursty day** (Llama-3-8B on H100): a diurnal day compressed into ``day_s``
   seconds with bursts on top; an HPA-style autoscaler on in-flight requests per replica, cold
   starts charged from the weight bytes over NVMe plus start-up (``labkit.sim.presets``). Against
   it, static provisioning: the smallest fixed fleet that meets the same TTFT SLO on the same
   trace (searched down from the autoscaler's peak). Reported: SLO attainment and replica-hours
   of each, and the saving.

3. **Canary on real replicas** (:func:`canary_fields`): two ``labkit serve`` processes, one
   the baseline, one the candidate behind a fault injector; the router gives the candidate half
   the traffic. A candidate made 1 s slower, then one failing half its requests, must be rolled
   back (``canary_bad_rolled_back_after``: candidate requests at rollback, the worse of the two);
   the same candidate without faults must not be (``canary_good_rolled_back``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_json
from labkit.router.canary_demo import default_canary, run_canary, start_replicas
from labkit.router.policies import get_policy
from labkit.sim.autoscaler import Autoscaler, AutoscalerConfig
from labkit.sim.fleet import Fleet, FleetConfig
from labkit.sim.presets import cold_start_s
from labkit.sim.traces import bursty_day, poisson_trace

MODEL, GPU, STORAGE = "llama-3-8b", "h100-sxm", "nvme-gen4"
QUICK = {"sizes": (4, 16, 64), "sweep_rate": 80.0, "sweep_s": 6.0, "sweep_scale": 4,
         "day_s": 240.0, "peak_rate": 108.0, "day_scale": 16}
FULL = {"sizes": (4, 8, 16, 32, 64), "sweep_rate": 120.0, "sweep_s": 15.0, "sweep_scale": 4,
        "day_s": 480.0, "peak_rate": 144.0, "day_scale": 16}
SWEEP_POLICIES = ("round-robin", "least-outstanding", "prefix-affinity")
TTFT_SLO_S = 2.0
# The day's requests: chat with long answers, so one H100 saturates near ~25 requests/s and
# a day stays a few thousand requests (the simulator's cost is per token: labkit.sim.coarse).
DAY_REQUESTS = {"user_mean": 200, "output_mean": 600, "max_len": 4096}
DAY_EPS = 0.1
AUTOSCALER = {"metric": "rps", "target": 16.0, "interval_s": 1.0, "cooldown_s": 15.0,
              "window_s": 10.0, "min_replicas": 2, "max_replicas": 32}


def run_sweep(sizes: tuple[int, ...], rate: float, duration: float, token_scale: int,
              seed: int = 0, policies: tuple[str, ...] = SWEEP_POLICIES) -> list[dict[str, Any]]:
    """Every policy at every fleet size on the same Poisson trace."""
    tr = poisson_trace(rate, duration, num_tenants=64, seed=seed)
    cfg = FleetConfig(MODEL, GPU, token_scale)
    rows = []
    for n in tqdm(sizes, desc="affinity sweep", leave=False):
        for name in policies:
            res = Fleet(get_policy(name), n, cfg).run(tr.specs, tr.duration)
            s = res.summary()
            rows.append({"replicas": n, "policy": name, "requests": s["requests"],
                         "hit_rate": s["hit_rate"], "ttft_p50": s["ttft_p50"],
                         "ttft_p99": s["ttft_p99"]})
    return rows


def _day_fleet(n: int, token_scale: int, autoscaler: Autoscaler | None, cold: float) -> Fleet:
    # a tight load bound: under an autoscaler the fleet runs hot, and the busiest replica, not
    # the average one, hits the knee first
    return Fleet(get_policy("prefix-affinity", eps=DAY_EPS), n,
                 FleetConfig(MODEL, GPU, token_scale), autoscaler, cold_start_s=cold,
                 interval_s=AUTOSCALER["interval_s"])


def run_static(tr: Any, n: int, token_scale: int, slo_s: float,
               warmup_s: float = 30.0) -> dict[str, Any]:
    """A static fleet of ``n`` over the busy part of the day only (where every burst and the
    peak are; the rest of the day has less load, so a fleet that meets the SLO here meets it
    there too), after ``warmup_s`` of the trace before it to fill caches and queues. Billed
    ``n`` for the whole day; SLO misses are counted against all the day's requests."""
    d = tr.meta["day_s"]
    w0, w1 = tr.meta["busy"][0] * d, tr.meta["busy"][1] * d
    specs = [x for x in tr.specs if w0 - warmup_s <= x.arrival_time < w1]
    res = _day_fleet(n, token_scale, None, 0.0).run(specs, w1)
    window = [r for r in res.requests if r["arrival"] >= w0]
    misses = sum(r["ttft"] > slo_s for r in window)
    return {"replicas": n, "replica_hours": n * d / 3600,
            "slo_attainment": 1 - misses / len(tr.specs), "window_requests": len(window),
            "window_ttft_p99": float(np.percentile([r["ttft"] for r in window], 99)),
            "hit_rate": res.hit_rate}


def run_day(day_s: float, peak_rate: float, token_scale: int, seed: int = 0,
            slo_s: float = TTFT_SLO_S) -> dict[str, Any]:
    """The autoscaled fleet over the whole day, then the smallest static fleet that meets the
    SLO for >= 99% of requests (bisection between 0 and the autoscaler's peak size)."""
    tr = bursty_day(day_s, peak_rate, seed=seed, **DAY_REQUESTS)
    cold = cold_start_s(MODEL, GPU, STORAGE)
    t0 = time.perf_counter()
    auto = _day_fleet(AUTOSCALER["min_replicas"], token_scale,
                      Autoscaler(AutoscalerConfig(**AUTOSCALER)), cold).run(tr.specs, day_s)
    a = auto.summary(slo_s)
    statics: dict[int, dict[str, Any]] = {}

    def static(n: int) -> dict[str, Any]:
        if n not in statics:
            statics[n] = run_static(tr, n, token_scale, slo_s)
        return statics[n]

    lo, hi = 0, a["max_replicas"]  # bisect: lo fails (or is 0), hi meets the SLO
    while static(hi)["slo_attainment"] < 0.99 and hi < 4 * a["max_replicas"]:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if static(mid)["slo_attainment"] >= 0.99 else (mid, hi)
    return {"trace": tr.meta, "requests": len(tr.specs), "cold_start_s": cold,
            "storage": STORAGE, "autoscaler_config": AUTOSCALER, "ttft_slo_s": slo_s,
            "autoscaled": a, "static": [v for _, v in sorted(statics.items())],
            "static_replicas": hi, "static_summary": static(hi),
            "timeline": auto.timeline, "wall_s": time.perf_counter() - t0,
            "rate_curve": [(t, tr.rate(t)) for t in [i * day_s / 480 for i in range(481)]]}


CANARY_QUICK = {"bad_requests": 300, "good_requests": 160, "delay_s": 1.0, "error_rate": 0.5,
                "concurrency": 4, "weight": 0.5}
CANARY_FULL = {**CANARY_QUICK, "bad_requests": 600, "good_requests": 400}


def canary_fields(baseline_urls: list[str], candidate_url: str, quick: bool = True,
                  seed: int = 0) -> dict[str, Any]:
    """Three canary runs over the same replicas: slow, erroring, healthy (module doc, 3)."""
    cfg = CANARY_QUICK if quick else CANARY_FULL
    runs = {}
    for name, fault in tqdm([("slow", {"delay_s": cfg["delay_s"]}),
                             ("erroring", {"error_rate": cfg["error_rate"]}), ("healthy", {})],
                            desc="canary", leave=False):
        canary = default_canary(cfg["weight"], seed, **({"threshold": 3} if not fault else {}))
        n = cfg["good_requests" if not fault else "bad_requests"]
        r = run_canary(baseline_urls, candidate_url, n_requests=n,
                       concurrency=cfg["concurrency"], canary=canary, after_rollback=8, **fault)
        runs[name] = {k: r[k] for k in ("rolled_back", "rolled_back_after", "reason", "seen",
                                        "wall_s")} | {"fault": fault,
                                                      "threshold": canary.analysis.threshold}
    bad = [runs[k]["rolled_back_after"] for k in ("slow", "erroring")]
    return {"canary_bad_rolled_back_after": None if None in bad else max(bad),
            "canary_good_rolled_back": runs["healthy"]["rolled_back"],
            "canary": {"config": cfg, "analysis": {k: getattr(canary.analysis, k) for k in (
                "min_samples", "interval", "max_error_increase", "max_ttft_p99_ratio")},
                       "runs": runs}}


def run_canary_real(quick: bool = True, seed: int = 0) -> dict[str, Any]:
    """:func:`canary_fields` on two labkit-tiny replicas started (and stopped) here."""
    procs = start_replicas(2)
    try:
        return canary_fields([procs[0].url], procs[1].url, quick, seed)
    finally:
        for p in procs:
            p.stop()


def run(quick: bool = True, seed: int = 0, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    t0 = time.perf_counter()
    sweep = run_sweep(tuple(cfg["sizes"]), cfg["sweep_rate"], cfg["sweep_s"], cfg["sweep_scale"],
                      seed)
    sweep_wall = time.perf_counter() - t0
    day = run_day(cfg["day_s"], cfg["peak_rate"], cfg["day_scale"], seed)
    head = max(cfg["sizes"])
    canary = run_canary_real(quick, seed)
    pick = {r["policy"]: r for r in sweep if r["replicas"] == head}
    a, s = day["autoscaled"], day["static_summary"]
    return {
        "benchmark": "cluster", "quick": quick, "model": MODEL, "gpu": GPU, "seed": seed,
        "sizes": cfg,
        "sim_replicas": head,
        "sim_affinity_hit_rate": pick["prefix-affinity"]["hit_rate"],
        "sim_round_robin_hit_rate": pick["round-robin"]["hit_rate"],
        "sim_affinity_ttft_p50": pick["prefix-affinity"]["ttft_p50"],
        "sim_round_robin_ttft_p50": pick["round-robin"]["ttft_p50"],
        "sim_affinity_ttft_p99": pick["prefix-affinity"]["ttft_p99"],
        "sim_round_robin_ttft_p99": pick["round-robin"]["ttft_p99"],
        "autoscaler_slo_attainment": a["slo_attainment"],
        "autoscaler_replica_hours": a["replica_hours"],
        "static_replica_hours": s["replica_hours"],
        "static_slo_attainment": s["slo_attainment"],
        "static_replicas": day["static_replicas"],
        "replica_hours_saving": 1 - a["replica_hours"] / s["replica_hours"],
        "ttft_slo_s": day["ttft_slo_s"], "cold_start_s": day["cold_start_s"],
        **canary,
        "sweep": sweep, "day": day,
        "wall_s": {"sweep": sweep_wall, "day": day["wall_s"]}, "environment": environment(),
    }


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    day = payload["day"]
    fig = make_subplots(rows=2, cols=2, specs=[[{}, {}], [{"colspan": 2, "secondary_y": True},
                                                          None]],
                        subplot_titles=("prefix hit rate vs fleet size",
                                        "TTFT p50 (ms) vs fleet size",
                                        "a bursty day: replicas (autoscaled) and arrival rate"))
    for pol in SWEEP_POLICIES:
        rows = [r for r in payload["sweep"] if r["policy"] == pol]
        x = [r["replicas"] for r in rows]
        fig.add_scatter(x=x, y=[r["hit_rate"] for r in rows], name=pol, row=1, col=1)
        fig.add_scatter(x=x, y=[1e3 * r["ttft_p50"] for r in rows], name=pol, row=1, col=2,
                        showlegend=False)
    tl = day["timeline"]
    t = [p["t"] for p in tl]
    fig.add_scatter(x=t, y=[p["ready"] for p in tl], name="ready replicas", row=2, col=1)
    fig.add_scatter(x=t, y=[p["ready"] + p["starting"] for p in tl], name="ready + starting",
                    row=2, col=1)
    fig.add_scatter(x=t, y=[day["static_replicas"]] * len(t), name="static provisioning",
                    line={"dash": "dash"}, row=2, col=1)
    curve = day["rate_curve"]
    fig.add_scatter(x=[c[0] for c in curve], y=[c[1] for c in curve], name="arrivals/s",
                    line={"dash": "dot"}, row=2, col=1, secondary_y=True)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_xaxes(type="log", row=1, col=2)
    fig.update_layout(title=f"Simulated fleet: {payload['model']} on {payload['gpu']}, "
                      f"autoscaler SLO attainment {payload['autoscaler_slo_attainment']:.1%}, "
                      f"{payload['replica_hours_saving']:.0%} fewer replica-hours than static")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("cluster", __doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    payload = run(args.quick, args.seed)
    print(f"\nsimulated {MODEL} on {GPU}: one multi-tenant Poisson trace over N replicas")
    print_table(payload["sweep"])
    day = payload["day"]
    print(f"\na bursty day compressed into {day['trace']['day_s']:.0f} s, {day['requests']} "
          f"requests, TTFT SLO {day['ttft_slo_s']} s, cold start {day['cold_start_s']:.1f} s")
    print_table([{"fleet": "autoscaled", **_brief(day["autoscaled"])}]
                + [{"fleet": f"static {r['replicas']}", **_brief(r)} for r in day["static"]])
    print(f"\nautoscaler: {payload['autoscaler_slo_attainment']:.2%} of requests within the SLO "
          f"on {payload['autoscaler_replica_hours']:.3f} replica-hours; static "
          f"({payload['static_replicas']} replicas): {payload['static_replica_hours']:.3f} "
          f"-> {payload['replica_hours_saving']:.0%} fewer")
    write_json(args.json, payload)
    if args.json:
        try:
            write_chart(payload, Path(args.json).with_suffix(".html"))
        except ImportError:
            print("plotly is not installed (pip install labkit[lab]); chart skipped")
    return 0


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s.get(k, "") for k in ("slo_attainment", "replica_hours", "max_replicas",
                                       "hit_rate", "ttft_p99", "window_ttft_p99")}
