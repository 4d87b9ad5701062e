"""Canary plots: a candidate that degrades and gets rolled back, and PromQL beside the router.

Input is what :func:`labkit.router.canary_demo.run_canary` returns (every request with its arm,
client-side TTFT, status and the weight when it was sent; every verdict). Top: each request's
TTFT by arm over the request sequence, errors as crosses, the moment the fault started and the
first request sent after the rollback. Bottom: what each check compared (both arms' TTFT p99, the
candidate's allowed ceiling = ratio x baseline), coloured by its verdict.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"baseline": "#1f77b4", "candidate": "#d62728"}
VERDICT = {"wait": "#999999", "pass": "#2ca02c", "fail": "#ff7f0e", "rollback": "#d62728"}


def rollback_index(result: dict[str, Any]) -> int | None:
    """The first request sent after the rollback (weight 0 when it left), or None."""
    after = [r["i"] for r in result["requests"] if r.get("weight_at_start") == 0.0]
    return min(after) if after else None


def plot_canary(result: dict[str, Any], ratio: float | None = None) -> go.Figure:
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.14, row_heights=[0.6, 0.4],
                        subplot_titles=("client TTFT per request, by arm",
                                        "each check: TTFT p99 per arm (router's window)"))
    reqs = result["requests"]
    for arm in ("baseline", "candidate"):
        ok = [r for r in reqs if r["arm"] == arm and r["ttft"] is not None]
        fig.add_scatter(x=[r["i"] for r in ok], y=[r["ttft"] for r in ok], mode="markers",
                        name=arm, marker={"color": COLORS[arm], "size": 5}, row=1, col=1)
        bad = [r for r in reqs if r["arm"] == arm and r["ttft"] is None]
        if bad:
            top = max((r["ttft"] for r in reqs if r["ttft"]), default=1.0)
            fig.add_scatter(x=[r["i"] for r in bad], y=[top * 1.05] * len(bad), mode="markers",
                            name=f"{arm} error", marker={"color": COLORS[arm], "symbol": "x"},
                            row=1, col=1)
    if result.get("degrade_after") and (result.get("delay_s") or result.get("error_rate")):
        fig.add_vline(x=result["degrade_after"], line_dash="dot", row=1, col=1,
                      annotation_text="candidate degrades")
    rb = rollback_index(result)
    if rb is not None:
        fig.add_vline(x=rb, line_color="red", row=1, col=1, annotation_text="rolled back")
    checks = [c for c in result["checks"] if c["metrics"].get("candidate")]
    x = list(range(1, len(checks) + 1))
    for arm in ("baseline", "candidate"):
        fig.add_scatter(x=x, y=[c["metrics"][arm]["ttft_p99"] for c in checks],
                        mode="lines+markers", name=f"{arm} p99", showlegend=False,
                        line={"color": COLORS[arm]}, row=2, col=1)
    if ratio:
        base = [c["metrics"]["baseline"]["ttft_p99"] for c in checks]
        fig.add_scatter(x=x, y=[None if b is None else ratio * b for b in base],
                        mode="lines", name=f"{ratio}x baseline",
                        line={"dash": "dash", "color": "#555"}, row=2, col=1)
    fig.add_scatter(x=x, y=[c["metrics"]["candidate"]["ttft_p99"] for c in checks],
                    mode="markers", showlegend=False, hovertext=[c["reason"] for c in checks],
                    marker={"size": 11, "color": [VERDICT[c["action"]] for c in checks]},
                    row=2, col=1)
    fig.update_xaxes(title_text="request", row=1, col=1)
    fig.update_xaxes(title_text="check (grey: too few samples yet)", row=2, col=1)
    fig.update_yaxes(title_text="s", row=1, col=1)
    fig.update_yaxes(title_text="s", row=2, col=1)
    title = (f"rolled back after {result['rolled_back_after']} candidate requests: "
             f"{result['reason']}" if result["rolled_back"] else "candidate kept")
    fig.update_layout(title=title, height=620)
    return fig


def promql_table(rows: list[dict[str, Any]]) -> go.Figure:
    """The ``promql`` rows of a ``run_canary(..., prometheus=True)`` result as a table: each
    PromQL query, what Prometheus answered, the same number from the router's counters."""
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.6g}"

    cols = ["arm", "quantity", "PromQL", "Prometheus", "router /metrics"]
    vals = [[r["arm"] for r in rows], [r["quantity"] for r in rows], [r["promql"] for r in rows],
            [fmt(r["prometheus"]) for r in rows], [fmt(r["router"]) for r in rows]]
    fig = go.Figure(go.Table(header={"values": cols}, cells={"values": vals, "align": "left"},
                             columnwidth=[1, 1.2, 6, 1.3, 1.3]))
    fig.update_layout(title="the canary's numbers: PromQL beside the router's own counters",
                      height=160 + 60 * len(rows))
    return fig
