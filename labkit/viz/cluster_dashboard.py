"""Live per-replica view of a local cluster, and the timeline of a failover.

``ClusterDashboard`` polls every replica's own ``/metrics`` (as Prometheus would scrape each pod)
and the router's ``/admin/replicas``: per replica, the queue (requests running + waiting), KV
usage, and the prefix-cache hit rate since the dashboard started (hit tokens / prompt tokens:
what prefix-affinity routing is for). ``failover_timeline`` draws, for each stream of a
``labkit.bench.cluster_live.failover_run``, when each chunk reached the client and from which
replica, with the kill marked.
"""

from __future__ import annotations

import time
from typing import Any

from labkit.viz.serve_dashboard import PollingDashboard

PANELS = ("queue (running + waiting)", "KV usage (0-1)", "prefix hit rate since start")
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


class ClusterDashboard(PollingDashboard):
    def __init__(self, cluster: Any, width: int = 900, height: int = 520) -> None:
        import ipywidgets as w
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        self.cluster, self.t0 = cluster, time.monotonic()
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=PANELS,
                            vertical_spacing=0.08)
        for i, name in enumerate(cluster.names):
            for row in range(3):
                fig.add_scatter(x=[], y=[], mode="lines", name=name, legendgroup=name,
                                showlegend=row == 0, line={"color": COLORS[i % len(COLORS)]},
                                row=row + 1, col=1)
        fig.update_layout(width=width, height=height, margin={"t": 40}, xaxis3_title="seconds")
        self.fig = go.FigureWidget(fig)
        self.table = w.HTML()
        self.widget = w.VBox([self.table, self.fig])
        self.base = [self._counters(self.cluster.replica_metrics(i))
                     for i in range(len(cluster.names))]
        self.history: list[dict[str, Any]] = []

    @staticmethod
    def _counters(m: dict[str, float]) -> tuple[float, float]:
        return (m.get("labkit:prefix_cache_hits_total", 0.0),
                m.get("labkit:prefix_cache_queries_total", 0.0))

    def reset(self) -> None:
        """Start the hit-rate window again (e.g. before the next policy's run)."""
        self.base = [self._counters(self.cluster.replica_metrics(i))
                     for i in range(len(self.cluster.names))]

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"t": time.monotonic() - self.t0, "replicas": []}
        router = {s["name"]: s for s in self.cluster.replica_states()}
        for i, name in enumerate(self.cluster.names):
            m = self.cluster.replica_metrics(i)
            h, q = self._counters(m)
            h0, q0 = self.base[i]
            snap["replicas"].append({
                "name": name, "up": bool(m),
                "queue": m.get("labkit:num_requests_running", 0.0)
                + m.get("labkit:num_requests_waiting", 0.0),
                "kv": m.get("labkit:kv_cache_usage_perc", 0.0),
                "hit_rate": (h - h0) / (q - q0) if q > q0 else 0.0,
                "router_outstanding": router.get(name, {}).get("outstanding", 0),
                "breaker": router.get(name, {}).get("breaker", "?")})
        return snap

    def update(self) -> dict[str, Any]:
        snap = self.snapshot()
        self.history.append(snap)
        xs = [h["t"] for h in self.history]
        keys = ("queue", "kv", "hit_rate")
        with self.fig.batch_update():
            for i in range(len(self.cluster.names)):
                for row, key in enumerate(keys):
                    tr = self.fig.data[3 * i + row]
                    tr.x, tr.y = xs, [h["replicas"][i][key] for h in self.history]
        head = "".join(f"<th style='padding:0 10px'>{c}</th>" for c in
                       ("replica", "up", "breaker", "queue", "KV", "hit rate", "router holds"))
        rows = "".join(
            f"<tr><td>{r['name']}</td><td>{'yes' if r['up'] else 'DOWN'}</td>"
            f"<td>{r['breaker']}</td><td>{r['queue']:g}</td><td>{r['kv']:.0%}</td>"
            f"<td>{r['hit_rate']:.0%}</td><td>{r['router_outstanding']}</td></tr>"
            for r in snap["replicas"])
        self.table.value = f"<table><tr>{head}</tr>{rows}</table>"
        return snap


def failover_timeline(run: dict[str, Any], names: list[str]) -> Any:
    """One row per stream: a dot per chunk at its arrival time, coloured by the replica that
    produced it (the stream's first replica until its failover record, then the new one)."""
    import plotly.graph_objects as go

    t0 = min(r["start"] for r in run["records"])
    moves = {f["id"]: f for f in run["failovers"]}
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    fig = go.Figure()
    shown: set[str] = set()
    for k, r in enumerate(run["records"]):
        f = moves.get(r["id"])
        for rep, pts in ((r["replica"], [t for t in r["events"] if not f or t < f["time"]]),
                         (f and f["to"], [t for t in r["events"] if f and t >= f["time"]])):
            if not pts:
                continue
            fig.add_scatter(x=[t - t0 for t in pts], y=[k] * len(pts), mode="markers",
                            marker={"size": 5, "color": color[rep]}, name=rep,
                            legendgroup=rep, showlegend=rep not in shown)
            shown.add(rep)
    kill = run["kill_time"] - t0
    fig.add_vline(x=kill, line={"dash": "dash", "color": "red"},
                  annotation_text=f"SIGKILL {run['victim']}")
    fig.update_layout(height=320, width=900, xaxis_title="seconds since the first request",
                      yaxis_title="stream", yaxis={"dtick": 1},
                      title="every chunk each client received, by the replica that made it")
    return fig
