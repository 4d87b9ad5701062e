"""``labkit bench ops noisy-neighbour``: fcfs, fair queueing and per-tenant quotas side by side.

A light tenant sends a tenth of a heavy tenant's requests to one ``labkit serve``; the heavy
tenant offers about twice what the server can finish, so its backlog grows for the whole run
(checked: :mod:`labkit.bench.saturation`, ``inconclusive`` if it did not). The light tenant's
p99 TTFT alone and beside the heavy one, on three servers: ``fcfs`` (the light tenant queues
behind the backlog), ``fair`` (weighted fair queueing picks it next) and ``quota`` (fcfs, but no
tenant may run more than half the batch: ``--tenant-max-running``, :mod:`labkit.sched.quota`).
The machinery is ``labkit bench serve``'s fairness step
(:func:`labkit.bench.serve_fairness.fairness`); this runs it with the quota server added.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"light_n": 20, "heavy_mult": 10, "overload": 2.0, "fair_max_num_seqs": 4,
         "fair_max_tokens": 16}
FULL = {**QUICK, "light_n": 40, "fair_max_tokens": 24}
POLICIES = ("fcfs", "fair", "quota")


def run(quick: bool = True, sizes: dict[str, Any] | None = None,
        model: str = "labkit-tiny") -> dict[str, Any]:
    from labkit.bench.serve_fairness import fairness

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    with tqdm(desc="noisy-neighbour", unit="req") as bar:
        res = fairness(model, cfg, bar, policies=POLICIES)  # served as "labkit-tiny", the
        # name the load generator asks for
    rows = [{"policy": p, **{k: v for k, v in res[p].items() if k != "saturation"},
             "saturation": res[p]["saturation"]["verdict"]} for p in POLICIES]
    return {"benchmark": "ops noisy-neighbour", "quick": quick, "config": cfg, "rows": rows,
            **{f"{p}_light_p99_ttft_ratio": res[f"{p}_light_p99_ttft_ratio"] for p in POLICIES},
            "light_rate_req_s": res["light_rate_req_s"],
            "heavy_rate_req_s": res["heavy_rate_req_s"], "verdict": res["verdict"],
            "raw": res, "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    import plotly.graph_objects as go

    rows = payload["rows"]
    fig = go.Figure()
    for key, name in (("light_solo_p99_ttft_ms", "light alone"),
                      ("light_mixed_p99_ttft_ms", "light beside the heavy tenant"),
                      ("heavy_p99_ttft_ms", "heavy")):
        fig.add_bar(x=[r["policy"] for r in rows], y=[r[key] for r in rows], name=name)
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="p99 TTFT (ms)",
                      title=f"Noisy neighbour: fcfs, fair, quota ({payload['verdict']})")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("ops noisy-neighbour", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["policy", "light_solo_p99_ttft_ms", "light_mixed_p99_ttft_ms",
                                  "heavy_p99_ttft_ms", "heavy_request_throughput",
                                  "saturation"])
    print(f"verdict: {payload['verdict']}; light p99 with/without the neighbour: " + ", ".join(
        f"{p} {payload[f'{p}_light_p99_ttft_ratio']:.1f}x" for p in POLICIES))
    write_results(args.json, payload, write_chart)
    return 0
