"""``labkit bench ops length-routing``: separate pools for short and long prompts, measured.

The deployment notes ask whether short and long requests should share replicas. A long prompt's
prefill fills its replica's steps for a long time; a short chat routed to that replica waits
behind it, so the short requests' tail TTFT is set by the long ones. The router's
``length-aware`` policy (:class:`labkit.router.policies.LengthAware`) keeps long prompts on a
long pool. The experiment runs the router's own policy classes over the fleet simulator (every
replica the real scheduler over a roofline clock, Llama-3-8B on H100s, ``labkit.sim.fleet``) on a
bimodal workload: mostly short chats, a tenth long documents, Poisson arrivals (seeded), at
several rates. Reported per policy and rate: the short requests' TTFT p50 / p99, the long ones'
p99, and output tokens/s; ``short_p99_ratio`` is length-aware over least-outstanding at the
reference rate. Simulated numbers: the machine running them does not change them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.router.policies import LeastOutstanding, LengthAware
from labkit.sim.fleet import Fleet, FleetConfig
from labkit.sim.workloads import RequestSpec

QUICK = {"num_requests": 600, "replicas": 4, "long_replicas": 1, "rates": [20.0, 40.0, 60.0],
         "reference_rate": 40.0, "long_share": 0.1, "threshold": 1024, "seed": 0}
FULL = {**QUICK, "num_requests": 3000, "rates": [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]}
SHORT, LONG = ((64, 512), (64, 256)), ((3072, 6144), (16, 64))  # (prompt, output) ranges


def workload(n: int, rate: float, long_share: float, seed: int) -> list[RequestSpec]:
    """``n`` requests, Poisson at ``rate`` per second; a ``long_share`` of them long."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    specs = []
    for i in range(n):
        (p_lo, p_hi), (o_lo, o_hi) = LONG if rng.random() < long_share else SHORT
        specs.append(RequestSpec(int(rng.integers(p_lo, p_hi)), int(rng.integers(o_lo, o_hi)),
                                 float(t[i]), seed=seed * 1_000_003 + i))
    return specs


def run_policy(policy: Any, specs: list[RequestSpec], replicas: int,
               threshold: int) -> dict[str, Any]:
    """One fleet run; TTFT percentiles of the short and the long requests, tokens/s."""
    res = Fleet(policy, replicas, FleetConfig(enable_prefix_caching=False)).run(specs)
    by_id = {f"r{i}": s for i, s in enumerate(sorted(specs, key=lambda s: s.arrival_time))}
    short = np.array([r["ttft"] for r in res.requests
                      if by_id[r["request_id"]].prompt_len < threshold])
    long_ = np.array([r["ttft"] for r in res.requests
                      if by_id[r["request_id"]].prompt_len >= threshold])
    end = max(r["arrival"] + r["e2e"] for r in res.requests)
    return {"short_ttft_p50_ms": 1e3 * float(np.percentile(short, 50)),
            "short_ttft_p99_ms": 1e3 * float(np.percentile(short, 99)),
            "long_ttft_p99_ms": 1e3 * float(np.percentile(long_, 99)) if len(long_) else None,
            "output_tokens_per_s": sum(s.output_len for s in specs) / end,
            "num_short": int(len(short)), "num_long": int(len(long_))}


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    rows = []
    for rate in tqdm(cfg["rates"], desc="length-routing"):
        specs = workload(cfg["num_requests"], rate, cfg["long_share"], cfg["seed"])
        for name, pol in (("least-outstanding", LeastOutstanding()),
                          ("length-aware", LengthAware(cfg["threshold"], cfg["long_replicas"]))):
            rows.append({"rate": rate, "policy": name,
                         **run_policy(pol, specs, cfg["replicas"], cfg["threshold"])})
    ref = {r["policy"]: r for r in rows if r["rate"] == cfg["reference_rate"]}
    return {"benchmark": "ops length-routing", "quick": quick, "config": cfg,
            "model": "llama-3-8b", "gpu": "h100-sxm", "short_prompts": SHORT[0],
            "long_prompts": LONG[0], "rows": rows,
            "short_p99_ratio": ref["length-aware"]["short_ttft_p99_ms"]
            / ref["least-outstanding"]["short_ttft_p99_ms"],
            "throughput_ratio": ref["length-aware"]["output_tokens_per_s"]
            / ref["least-outstanding"]["output_tokens_per_s"],
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for pol, dash in (("least-outstanding", None), ("length-aware", "dash")):
        pts = [r for r in payload["rows"] if r["policy"] == pol]
        fig.add_scatter(x=[r["rate"] for r in pts], y=[r["short_ttft_p99_ms"] for r in pts],
                        name=f"{pol}: short p99", line={"dash": dash})
        fig.add_scatter(x=[r["rate"] for r in pts], y=[r["long_ttft_p99_ms"] for r in pts],
                        name=f"{pol}: long p99", line={"dash": dash}, mode="lines+markers")
    fig.update_layout(title="TTFT p99 of short and long prompts, 4 replicas (simulated "
                      "Llama-3-8B, H100)", xaxis_title="arrival rate (req/s)",
                      yaxis_title="ms", yaxis_type="log")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("ops length-routing", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["rate", "policy", "short_ttft_p50_ms", "short_ttft_p99_ms",
                                  "long_ttft_p99_ms", "output_tokens_per_s"])
    print(f"at {payload['config']['reference_rate']:g} req/s: short p99 length-aware / "
          f"least-outstanding = {payload['short_p99_ratio']:.2f}x, tokens/s "
          f"{payload['throughput_ratio']:.2f}x")
    write_results(args.json, payload, write_chart)
    return 0
