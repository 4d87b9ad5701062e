"""A live dashboard over a server's ``/metrics``: queue, running, KV usage, 429s, TTFT.

It polls the Prometheus endpoint like Grafana would, so it works against any labkit server (in
a thread, a child process, or another machine) and shows exactly what an operator would see.
Call ``update()`` in a loop (or ``watch(seconds)``) while a load runs.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from labkit.serve.metrics import parse_metrics

SERIES = (("labkit:num_requests_running", "running"), ("labkit:num_requests_waiting", "waiting"),
          ("labkit:kv_cache_usage_perc", "KV usage (0-1)"))


class PollingDashboard:
    """What every polling dashboard shares: ``watch`` calls ``update`` in a loop, and the
    notebook displays ``widget``."""

    widget: Any

    def update(self) -> Any:
        raise NotImplementedError

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
    def __init__(self, base_url: str, width: int = 820, height: int = 320) -> None:
        import ipywidgets as w
        import plotly.graph_objects as go

        self.url = base_url.rstrip("/") + "/metrics"
        self.t0 = time.monotonic()
        self.fig = go.FigureWidget(layout={"width": width, "height": height,
                                           "xaxis_title": "seconds", "margin": {"t": 30}})
        for _, label in SERIES:
            self.fig.add_scatter(x=[], y=[], mode="lines", name=label)
        self.table = w.HTML()
        self.widget = w.VBox([self.table, self.fig])
        self.history: list[dict[str, float]] = []

    def snapshot(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url, timeout=5).text)

    def update(self) -> dict[str, float]:
        m = self.snapshot()
        m["t"] = time.monotonic() - self.t0
        self.history.append(m)
        with self.fig.batch_update():
            for trace, (name, _) in zip(self.fig.data, SERIES):
                trace.x = [h["t"] for h in self.history]
                trace.y = [h.get(name, 0.0) for h in self.history]
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
