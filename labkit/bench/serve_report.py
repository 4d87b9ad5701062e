"""What ``labkit bench serve`` prints and plots from its payload (kept apart from the
measuring, :mod:`labkit.bench.serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labkit.bench.common import print_table


def print_report(payload: dict[str, Any]) -> None:
    """The run in a few lines: the sweep's table, the headline against in-process, every
    engine variant, the knee beside the simulator, the noisy neighbour."""
    cols = ["request_rate", "completed", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms"]
    print_table(payload["sweep"], cols)
    print(f"\nconcurrency {payload['max_concurrency']}: {payload['output_throughput']:.1f} "
          f"output tok/s over HTTP", end="")
    if "in_process_output_throughput" in payload:
        print(f", {payload['in_process_output_throughput']:.1f} in process "
              f"(ratio {payload['http_over_in_process']:.2f}); concurrency 1 TTFT p50 "
              f"{payload['concurrency_1']['median_ttft_ms']:.1f} ms vs "
              f"{payload['in_process_median_ttft_ms']:.1f} ms in process")
    for m, by_t in payload.get("engine_modes", {}).items():
        for t, r in by_t.items():
            print(f"  engine in a {m}, {t} torch thread(s): {r['output_throughput']:.1f} tok/s "
                  f"({r['http_over_in_process']:.2f}x in process), c1 TTFT p50 "
                  f"{r['c1_median_ttft_ms']:.1f} ms ({r['c1_ttft_overhead_ms']:+.1f} ms)")
    if "in_process_threads" in payload:
        print(f"  in process: best throughput with {payload['in_process_threads']['throughput']}"
              f" thread(s), best TTFT with {payload['in_process_threads']['ttft']}")
    if "knee" in payload:
        k = payload["knee"]
        print(f"knee: measured capacity {k['measured_capacity_req_s']:.2f} req/s, simulator "
              f"(fitted step time, r2 {k['step_fit']['r2']:.2f}) "
              f"{k['simulated_capacity_req_s']:.2f} req/s: {k['measured_over_simulated']:.2f}x"
              + ("" if k["verdict"] == "conclusive" else f"; {k['verdict']}"))
    if "fairness" in payload:
        f = payload["fairness"]
        print(f"noisy neighbour (heavy tenant at {f['heavy_rate_req_s']:.1f} req/s, calibrated "
              f"from a measured capacity of {f['capacity_req_s']:.1f} req/s, light at a tenth "
              "of that): ", end="")
        if f["verdict"] != "conclusive":
            print(f["verdict"])
        else:
            print(f"light tenant p99 TTFT with / without: fcfs "
                  f"{f['fcfs_light_p99_ttft_ratio']:.2f}x, fair "
                  f"{f['fair_light_p99_ttft_ratio']:.2f}x")


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    rows = payload["sweep"]
    x = [r["request_throughput"] for r in rows]
    labels = [f"rate {r['request_rate']}" for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "TPOT (ms)"))
    for q, dash in (("median", None), ("p99", "dot")):
        fig.add_scatter(x=x, y=[r[f"{q}_ttft_ms"] for r in rows], text=labels, row=1, col=1,
                        mode="lines+markers", name=f"{q} TTFT", line={"dash": dash})
        fig.add_scatter(x=x, y=[r[f"{q}_tpot_ms"] for r in rows], text=labels, row=1, col=2,
                        mode="lines+markers", name=f"{q} TPOT", line={"dash": dash})
    sim = payload.get("simulated_sweep")
    if sim:  # the simulator on the fitted step time, same requests and arrivals (serve_knee)
        fig.add_scatter(x=[r["request_throughput"] for r in sim],
                        y=[r["p99_ttft_ms"] for r in sim], row=1, col=1, mode="lines+markers",
                        text=[f"rate {r['request_rate']}" for r in sim],
                        name="p99 TTFT, simulated engine", line={"dash": "dash"})
        for name, cap in (("measured", payload["knee"]["measured_capacity_req_s"]),
                          ("simulated", payload["knee"]["simulated_capacity_req_s"])):
            fig.add_vline(x=cap, line_dash="dot", row=1, col=1,
                          annotation_text=f"{name} capacity {cap:.2f}/s")
    fig.update_xaxes(title_text="achieved requests/s")
    fig.update_layout(title="labkit serve: latency against load (the knee is where the queue "
                      "starts to grow), beside the simulator's prediction")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")
