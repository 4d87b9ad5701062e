"""``labkit bench disagg-sim``: the simulator's goodput frontier, colocated vs prefill/decode.

Why a simulated bench beside the live one (``labkit bench disagg``): on the lab's 2-core CPU
the two instances share the cores, so a measured P/D pair can show the mechanism (the bytes,
the outputs) but not what disaggregation buys on GPUs. :mod:`labkit.sim.disagg` answers that
for Llama-3-8B on H100-SXMs with the roofline: per deployment (one or two colocated GPUs;
1:1, 1:2 and 2:1 prefill:decode GPUs, the KV over NVLink 4, PCIe 5, 400 Gb/s and 100 Gb/s),
the highest Poisson arrival rate at which 90% of requests meet both a TTFT SLO and a TPOT SLO
(DistServe's goodput), per GPU so deployments of different sizes compare. Two TPOT SLOs: a
generous one (only TTFT binds, and colocated GPUs that all prefill do well) and a tight one
(every colocated prefill stalls the running decodes, and keeping them apart wins). Also an
attainment-vs-rate sweep (the curves the goodput is read from) and the KV bytes each request
moves with each link's transfer time.

Simulated numbers do not depend on the machine's load, so ``datasets/results/disagg_sim.json``
may be regenerated anywhere: ``labkit bench disagg-sim --json datasets/results/disagg_sim.json``.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.sim.disagg import (
    KV_LINKS,
    Deployment,
    Workload,
    attainment_at,
    frontier,
    kv_bytes_per_request,
    transfer_s,
)

MODEL, GPU, TARGET = "llama-3-8b", "h100-sxm", 0.9
SLOS = {"generous TPOT": {"ttft_slo": 0.4, "tpot_slo": 0.1},
        "tight TPOT": {"ttft_slo": 0.4, "tpot_slo": 0.015}}
QUICK = {"num_requests": 400, "links": ("nvlink4", "eth-100g"), "sweep_points": 6}
FULL = {"num_requests": 1500, "links": tuple(KV_LINKS), "sweep_points": 12}


def transfer_table(wl: Workload) -> list[dict[str, Any]]:
    """KV bytes of a mean-length prompt and its transfer time per link."""
    mean_prompt = sum(wl.prompt_range) // 2
    nbytes = kv_bytes_per_request(MODEL, mean_prompt)
    return [{"link": name, "bandwidth_GBps": link.bandwidth / 1e9, "prompt_tokens": mean_prompt,
             "kv_bytes": nbytes, "transfer_ms": 1e3 * transfer_s(nbytes, name),
             "source": link.source} for name, link in KV_LINKS.items()]


def sweep(wl: Workload, max_rate_per_gpu: float, points: int) -> list[dict[str, Any]]:
    """SLO attainment against per-GPU arrival rate for colocated x2 and the three splits over
    NVLink: the curves whose crossing of the target is the goodput."""
    deps = [Deployment(0, 2)] + [Deployment(p, d) for p, d in ((1, 1), (1, 2), (2, 1))]
    rows = []
    for dep in deps:
        for i in range(1, points + 1):
            per_gpu = max_rate_per_gpu * i / points
            rows.append({"deployment": dep.name, "rate_per_gpu": per_gpu,
                         "attainment": attainment_at(dep, per_gpu * dep.num_gpus, wl, MODEL,
                                                     GPU)})
    return rows


def run(quick: bool = True, sizes: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    base = Workload(num_requests=cfg["num_requests"], seed=seed)
    out: dict[str, Any] = {"benchmark": "disagg-sim", "model": MODEL, "gpu": GPU,
                           "quick": quick, "target_attainment": TARGET, "sizes": cfg,
                           "workload": asdict(base), "kv_transfer": transfer_table(base),
                           "frontier": {}, "sweep": {}}
    for label, slo in SLOS.items():
        wl = replace(base, **slo)
        rows = frontier(wl, tuple(cfg["links"]), TARGET, MODEL, GPU)
        out["frontier"][label] = {"slo": slo, "rows": rows}
        best = max(r["goodput_per_gpu"] for r in rows)
        out["sweep"][label] = sweep(wl, 1.5 * best, cfg["sweep_points"])
    for label in SLOS:
        rows = {r["deployment"]: r["goodput_per_gpu"] for r in out["frontier"][label]["rows"]}
        key = label.split()[0]
        out[f"{key}_colocated_per_gpu"] = rows["colocated x2"]
        out[f"{key}_1p1d_nvlink_per_gpu"] = rows["1P:1D nvlink4"]
        out[f"{key}_disagg_vs_colocated"] = rows["1P:1D nvlink4"] / rows["colocated x2"]
        out[f"{key}_best"] = max(rows, key=rows.get)
    out["environment"] = environment()
    return out


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    labels = list(payload["frontier"])
    fig = make_subplots(rows=2, cols=len(labels), subplot_titles=[
        *(f"{lab}: goodput per GPU (req/s, {payload['target_attainment']:.0%} attainment)"
          for lab in labels), *(f"{lab}: SLO attainment vs rate per GPU" for lab in labels)])
    for col, lab in enumerate(labels, start=1):
        rows = payload["frontier"][lab]["rows"]
        fig.add_bar(x=[r["deployment"] for r in rows], y=[r["goodput_per_gpu"] for r in rows],
                    row=1, col=col, showlegend=False)
        for dep in dict.fromkeys(r["deployment"] for r in payload["sweep"][lab]):
            pts = [r for r in payload["sweep"][lab] if r["deployment"] == dep]
            fig.add_scatter(x=[r["rate_per_gpu"] for r in pts], y=[r["attainment"] for r in pts],
                            name=dep, legendgroup=dep, showlegend=col == 1, row=2, col=col)
        fig.add_hline(y=payload["target_attainment"], line_dash="dot", row=2, col=col)
    fig.update_layout(title=f"Simulated P/D disaggregation: {payload['model']} on "
                      f"{payload['gpu']} (roofline, Poisson arrivals)", height=800)
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("disagg-sim", __doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    payload = run(quick=args.quick, seed=args.seed)
    print_table(payload["kv_transfer"], ["link", "bandwidth_GBps", "prompt_tokens", "kv_bytes",
                                         "transfer_ms"])
    for label, f in payload["frontier"].items():
        print(f"\n{label} (TTFT <= {f['slo']['ttft_slo']} s, TPOT <= {f['slo']['tpot_slo']} s)")
        print_table(f["rows"], ["deployment", "gpus", "goodput_rps", "goodput_per_gpu"])
    write_results(args.json, payload, write_chart)
    return 0
