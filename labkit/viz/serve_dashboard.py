"""A live dashboard over a server's ``/metrics``: queue, running, KV usage, 429s, TTFT.

It polls the Prometheus endpoint like Grafana would, so it works against any labkit server (in
a thread, a child process, or another machine) and shows exactly what an operator would see.
Call ``update()`` in a loop (or ``watch(seconds)``) while a load runs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import httpx

from labkit.serve.metrics import parse_metrics

# (metric, label, axis): request counts on the left axis, KV usage (a fraction) on its own
# right axis, 0-100%: on the count axis a usage of 0.6 beside 4 running requests drew as flat.
SERIES = (("labkit:num_requests_running", "running", "y"),
          ("labkit:num_requests_waiting", "waiting", "y"),
          ("labkit:kv_cache_usage_perc", "KV usage (right axis)", "y2"))


class PollingDashboard(ABC):
    """What every polling dashboard shares: ``watch`` calls ``update`` in a loop, and the
    notebook displays ``widget``."""

    widget: Any

    @abstractmethod
    def update(self) -> Any:
        """Poll once and redraw; each dashboard says what it polls."""

    def watch(self, seconds: float, interval: float = 0.25, until: Any = None) -> None:
        """Poll for ``seconds`` (or until ``until()`` is true)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            self.update()
            time.sleep(interval)
        self.update()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


class ServeDashboard(PollingDashboard):
    """The series over time in a FigureView (a plotly mime bundle per redraw: the figure's
    JSON, not a FigureWidget's plotly.js copy), above a table of the latest values."""

    def __init__(self, base_url: str, width: int = 820, height: int = 320) -> None:
        import ipywidgets as w

        from labkit.viz.figure_view import FigureView

        self.url = base_url.rstrip("/") + "/metrics"
        self.t0 = time.monotonic()
        self.size = {"width": width, "height": height}
        self.view = FigureView("labkit-serve-dashboard")
        self.table = w.HTML()
        self.widget = w.VBox([self.table, self.view])
        self.history: list[dict[str, float]] = []
        self.view.show(self.figure())

    @property
    def fig(self) -> Any:
        """The figure last drawn."""
        return self.view.figure

    def figure(self) -> Any:
        """The series of ``history`` as a plotly figure."""
        import plotly.graph_objects as go

        t = [h["t"] for h in self.history]
        fig = go.Figure(layout={
            **self.size, "xaxis_title": "seconds", "margin": {"t": 30},
            "yaxis": {"title": "requests", "rangemode": "tozero"},
            "yaxis2": {"title": "KV cache usage", "overlaying": "y", "side": "right",
                       "range": [0, 1.05], "tickformat": ".0%", "showgrid": False},
            "legend": {"orientation": "h", "y": 1.12}})
        for name, label, axis in SERIES:
            fig.add_scatter(x=t, y=[h.get(name, 0.0) for h in self.history], mode="lines",
                            name=label, yaxis=axis, line={"dash": "dot"} if axis == "y2" else {})
        return fig

    def snapshot(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url, timeout=5).text)

    def update(self) -> dict[str, float]:
        m = self.snapshot()
        m["t"] = time.monotonic() - self.t0
        self.history.append(m)
        self.view.show(self.figure())
        n = m.get("labkit:time_to_first_token_seconds_count", 0.0)
        ttft = m.get("labkit:time_to_first_token_seconds_sum", 0.0) / n if n else 0.0
        cells = {"running": m.get("labkit:num_requests_running", 0),
                 "waiting": m.get("labkit:num_requests_waiting", 0),
                 "KV usage": f"{m.get('labkit:kv_cache_usage_perc', 0):.0%}",
                 "finished": m.get("labkit:request_success_total", 0),
                 "429/503 rejected": m.get("labkit:request_rejected_total", 0),
                 "aborted": m.get("labkit:request_aborted_total", 0),
                 "mean TTFT": f"{ttft * 1000:.0f} ms"}
        self.table.value = "<table><tr>" + "".join(
            f"<th style='padding:0 10px'>{k}</th>" for k in cells) + "</tr><tr>" + "".join(
            f"<td style='padding:0 10px;text-align:center'>{v:g}</td>" if isinstance(v, float)
            else f"<td style='padding:0 10px;text-align:center'>{v}</td>"
            for v in cells.values()) + "</tr></table>"
        return m
