"""LatencyWidget: TTFT, TPOT and inter-token latency distributions with their percentiles.

Serving SLOs are written in percentiles, not means: a scheduler that improves average throughput
can still blow up p99 time-to-first-token. The widget takes per-request timestamps (from a
SimResult, `engine.request_timings()`, or derived from a trace) and draws each distribution
with p50 / p90 / p99 marked.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz import tracedata as td

PERCENTILES = (50, 90, 99)


def latency_samples(timings: list[dict]) -> dict[str, list[float]]:
    """TTFT per sequence, TPOT per sequence (decode time / (tokens - 1)), every ITL gap (s)."""
    ttft, tpot, itl = [], [], []
    for t in timings:
        times = list(t.get("token_times") or [])
        first = t.get("first_token_time")
        if first is None and times:
            first = times[0]
        if first is None:
            continue
        ttft.append(first - t["arrival_time"])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(b - a for a, b in zip(times, times[1:]))
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl}


def _timings_of(source: Any) -> list[dict]:
    if isinstance(source, list):
        return source
    if hasattr(source, "timings") and source.timings is not None:  # SimResult
        return list(source.timings)
    if hasattr(source, "request_timings"):  # LLMEngine
        return source.request_timings()
    return td.derive_timings(td.as_trace_dict(source))


class LatencyWidget(widgets.VBox):
    """Histograms of TTFT / TPOT / ITL (milliseconds) with p50, p90, p99 lines and a table."""

    def __init__(self, source: Any, nbins: int = 40) -> None:
        self.nbins = nbins
        self.figure = td.swap_figure(None, None, go.Figure(), "labkit-latency-figure")
        self.table = widgets.HTML()
        super().__init__([self.table, self.figure])
        self.add_class("labkit-latency")
        self.set_source(source)

    def set_source(self, source: Any) -> None:
        """A SimResult, LLMEngine, list of timing dicts, or a trace."""
        timings = _timings_of(source)
        self.samples = latency_samples(timings)
        if not self.samples["TTFT"]:
            raise ValueError("no request produced a token: nothing to plot")
        from labkit.engine.metrics import compute_metrics

        self.metrics = compute_metrics(timings)
        fig = make_subplots(rows=1, cols=3, subplot_titles=tuple(self.samples))
        rows = []
        for col, (name, xs) in enumerate(self.samples.items(), start=1):
            ms = np.asarray(xs, dtype=float) * 1e3
            fig.add_trace(go.Histogram(x=ms, nbinsx=self.nbins, name=name, showlegend=False,
                                       marker_color="#4c78a8"), row=1, col=col)
            summary = self.metrics[name.lower()]
            cells = []
            for key, dash in (("p50", "solid"), ("p90", "dash"), ("p99", "dot")):
                v = summary.get(key)
                cells.append("–" if v is None else f"{v * 1e3:.2f}")
                if v is not None:
                    fig.add_vline(x=v * 1e3, line=dict(color="#e45756", dash=dash),
                                  annotation_text=key, row=1, col=col)
            fig.update_xaxes(title_text="ms", row=1, col=col)
            mean = summary.get("mean")
            rows.append(f"<tr><td>{name}</td><td>{ms.size}</td>"
                        f"<td>{'–' if mean is None else f'{mean * 1e3:.2f}'}</td>"
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        fig.update_layout(height=320, width=900, plot_bgcolor="white", bargap=0.05,
                          margin=dict(l=50, r=20, t=40, b=40))
        self.figure = td.swap_figure(self, self.figure, fig, "labkit-latency-figure")
        self.table.value = ("<table><tr><th>metric (ms)</th><th>samples</th><th>mean</th>"
                            + "".join(f"<th>p{q}</th>" for q in PERCENTILES) + "</tr>"
                            + "".join(rows) + "</table>")
