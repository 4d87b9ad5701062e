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
from labkit.viz.figure_view import FigureView

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


COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2")
# p50 / p90 / p99 labels sit at different heights so close percentiles never overlap.
MARKS = (("p50", "solid", 0), ("p90", "dash", -16), ("p99", "dot", -32))


class LatencyWidget(widgets.VBox):
    """Histograms of TTFT / TPOT / ITL (milliseconds) with p50, p90, p99 lines and a table.

    `source`: one run (a SimResult, LLMEngine, timing list or trace), or a dict of labelled
    runs to compare (e.g. ``{"budget 512": a, "budget 8192": b}``): their histograms overlay
    in different colours, each with its own p99 line, and the table has one row per run.
    """

    def __init__(self, source: Any, nbins: int = 40) -> None:
        self.nbins = nbins
        self.view = FigureView("labkit-latency-figure")
        self.table = widgets.HTML()
        super().__init__([self.table, self.view])
        self.add_class("labkit-latency")
        self.set_source(source)

    def set_source(self, source: Any) -> None:
        """One run, or a dict of labelled runs (see the class docstring)."""
        from labkit.engine.metrics import compute_metrics

        runs = source if isinstance(source, dict) and "steps" not in source else {"": source}
        self.runs: dict[str, dict] = {}
        for label, src in runs.items():
            timings = _timings_of(src)
            samples = latency_samples(timings)
            if not samples["TTFT"]:
                raise ValueError(f"no request produced a token{f' in {label!r}' if label else ''}"
                                 ": nothing to plot")
            self.runs[label] = {"samples": samples, "metrics": compute_metrics(timings)}
        first = next(iter(self.runs.values()))
        self.samples, self.metrics = first["samples"], first["metrics"]
        fig = make_subplots(rows=1, cols=3, subplot_titles=tuple(self.samples))
        rows = []
        for i, ((label, run), color) in enumerate(zip(self.runs.items(), COLORS)):
            rows += self._draw(fig, label, run, color, i if len(self.runs) > 1 else None)
        fig.update_layout(height=340, width=900, plot_bgcolor="white", bargap=0.05,
                          barmode="overlay", showlegend=len(self.runs) > 1,
                          legend=dict(orientation="h", y=-0.2),
                          margin=dict(l=50, r=20, t=60, b=40))
        self.figure = self.view.show(fig)
        self.table.value = ("<table><tr><th>run</th><th>metric (ms)</th><th>samples</th>"
                            "<th>mean</th>" + "".join(f"<th>p{q}</th>" for q in PERCENTILES)
                            + "</tr>" + "".join(rows) + "</table>")

    def _draw(self, fig: go.Figure, label: str, run: dict, color: str,
              index: int | None) -> list[str]:
        """One run's histograms and percentile lines (only p99, one label height per run,
        when ``index`` says several runs share the axes); returns its table rows."""
        rows, many = [], index is not None
        for col, (name, xs) in enumerate(run["samples"].items(), start=1):
            ms = np.asarray(xs, dtype=float) * 1e3
            fig.add_trace(go.Histogram(x=ms, nbinsx=self.nbins, name=label or name,
                                       legendgroup=label, showlegend=many and col == 1,
                                       opacity=0.6 if many else 1.0, marker_color=color),
                          row=1, col=col)
            summary = run["metrics"][name.lower()]
            for key, dash, shift in MARKS:
                v = summary.get(key)
                if v is None or (many and key != "p99"):
                    continue
                text = f"{key} {label}: {v * 1e3:.0f} ms" if many else key
                fig.add_vline(x=v * 1e3, line=dict(color=color if many else "#e45756",
                                                   dash=dash), row=1, col=col,
                              annotation=dict(text=text, yshift=-16 * index if many else shift,
                                              font=dict(size=10), showarrow=False))
            fig.update_xaxes(title_text="ms", row=1, col=col)
            mean = summary.get("mean")
            cells = ["–" if summary.get(k) is None else f"{summary[k] * 1e3:.2f}"
                     for k in ("p50", "p90", "p99")]
            rows.append(f"<tr><td>{label}</td><td>{name}</td><td>{ms.size}</td>"
                        f"<td>{'–' if mean is None else f'{mean * 1e3:.2f}'}</td>"
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return rows
