"""ScheduleWidget: what the scheduler ran at every step, as a Gantt chart.

Continuous batching is easiest to understand by looking at it: requests join the running batch
the step after they arrive, long prompts are split into chunks so decodes are not starved, and
under memory pressure a request is preempted and later recomputed. Rows are requests, columns are
engine steps; the bar above shows how much of the per-step token budget each step used.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView


class ScheduleWidget(widgets.VBox):
    """Gantt chart (steps × requests) of a trace plus the token budget used per step.

    `max_requests` / `max_steps` bound what is drawn (the first ones) for big simulations.
    Set `.step` (or link a PageTableWidget's slider to it) to mark a step. `groups` (request
    id -> label, e.g. its LoRA adapter) writes each row's label beside its id, in the label's
    colour (the same colours as PageTableWidget's `groups`).
    """

    def __init__(self, trace: Any, max_requests: int = 64, max_steps: int = 600,
                 groups: dict[str, str] | None = None) -> None:
        self.max_requests, self.max_steps, self.groups = max_requests, max_steps, groups
        self.view = FigureView("labkit-schedule-figure")
        self.summary = widgets.HTML()
        self.summary.add_class("labkit-schedule-summary")
        super().__init__([self.summary, self.view])
        self.add_class("labkit-schedule")
        self.set_trace(trace)

    def set_trace(self, trace: Any) -> None:
        """Swap in a new trace and redraw in place."""
        self.trace = td.as_trace_dict(trace)
        rids, states = td.request_states(self.trace)
        steps = self.trace["steps"][: self.max_steps]
        rids, states = rids[: self.max_requests], [s[: len(steps)] for s in states]
        self.states = dict(zip(rids, states))
        code = {name: i for i, name in enumerate(td.STATES)}
        z = [[None if st is None else code[st] for st in row] for row in states]
        hover = [[self._hover(rid, i, st) for i, st in enumerate(row)]
                 for rid, row in zip(rids, states)]
        n = len(td.STATES)
        xs = [rec["step"] for rec in steps]
        gantt_h = 22 * max(len(rids), 4)
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                            row_heights=[120, gantt_h])
        fig.add_trace(go.Bar(x=xs, y=[rec["num_batched_tokens"] for rec in steps],
                             name="batched tokens", marker_color="#4c78a8", showlegend=True),
                      row=1, col=1)
        top = _budget_line(fig, xs, steps)
        fig.add_trace(go.Heatmap(z=z, x=xs, y=rids, zmin=-0.5, zmax=n - 0.5,
                                 colorscale=_state_colorscale(),
                                 showscale=False, text=hover, hoverinfo="text",
                                 xgap=1 if len(xs) <= 120 else 0, ygap=1), row=2, col=1)
        _finished_marks(fig, steps, self.states)
        for name in td.STATES[:-1]:  # legend chips for the heatmap's categories
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                     marker=dict(symbol="square", size=12,
                                                 color=td.STATE_COLORS[name])), row=2, col=1)
        fig.update_yaxes(title_text="tokens", range=[0, top * 1.15], row=1, col=1)
        fig.update_yaxes(autorange="reversed", type="category", title_text="request",
                         row=2, col=1)
        if self.groups is not None:  # each request's label (its adapter), in the label's colour
            colors = td.request_color(self.trace, self.groups)
            fig.update_yaxes(tickvals=rids, ticktext=[
                f"<span style='color:{colors.get(r, '#444')}'>{r} · {self.groups.get(r, '')}"
                "</span>" for r in rids], row=2, col=1)
        fig.update_xaxes(title_text="engine step", row=2, col=1)
        fig.update_layout(height=120 + gantt_h + 110, width=900, plot_bgcolor="white",
                          margin=dict(l=70, r=20, t=20, b=40), bargap=0.1,
                          legend=dict(x=1.02, y=1, xanchor="left"))
        self._base, self._step = fig, None
        self.figure = self.view.show(fig)
        self.summary.value = self._summary_html(len(steps))

    @property
    def step(self) -> int | None:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        """Mark `step` with a vertical band (link a slider to it with `observe`)."""
        fig = go.Figure(self._base)
        fig.layout.shapes = [dict(type="rect", xref="x2", yref="paper", x0=step - 0.5,
                                  x1=step + 0.5, y0=0, y1=1, line=dict(color="black", width=1.5),
                                  fillcolor="rgba(0,0,0,0.06)")]
        self._step = step
        self.figure = self.view.show(fig)

    def _hover(self, rid: str, i: int, st: str | None) -> str:
        if st is None:
            return ""
        rec = self.trace["steps"][i]
        toks = sum(s["num_tokens"] for s in rec.get("scheduled", ()) if s["request_id"] == rid)
        detail = f", {toks} tokens" if toks else ""
        return f"request {rid} · step {rec['step']}: {st}{detail}"

    def _summary_html(self, shown_steps: int) -> str:
        steps = self.trace["steps"]
        used = sum(r["num_batched_tokens"] for r in steps)
        budget = sum(r["token_budget"] for r in steps) or 1
        pre = sum(len(r.get("preempted", ())) for r in steps)
        chunks = sum(1 for r in steps for s in r.get("scheduled", ()) if s.get("chunked"))
        meta = self.trace["meta"]
        clipped = "" if shown_steps == len(steps) and len(self.states) == len(
            self.trace["requests"]) else (f" (showing {len(self.states)} requests × "
                                          f"{shown_steps} steps)")
        return (f"<div><b>{meta.get('batching', '?')} batching, policy {meta.get('policy', '?')}"
                f"</b>: {len(self.trace['requests'])} requests in {len(steps)} steps{clipped}; "
                f"token budget used {100 * used / budget:.1f}%; {chunks} chunked-prefill "
                f"chunks; {pre} preemptions</div>")


def _budget_line(fig: go.Figure, xs: list[int], steps: list[dict]) -> float:
    """Draw the per-step token budget where it does not flatten the bars; returns the top of
    the bar axis. A budget far above what any step used (2,048 against steps of 40 tokens)
    would squash the bars to nothing, so it is then stated in a corner and its line is left
    to the legend (click it to show)."""
    used = max(rec["num_batched_tokens"] for rec in steps) or 1
    budget = max(rec["token_budget"] for rec in steps)
    fits = budget <= 2 * used
    fig.add_trace(go.Scatter(x=xs, y=[rec["token_budget"] for rec in steps], mode="lines",
                             line=dict(color="#e45756", dash="dash", shape="hvh"),
                             name="token budget", visible=True if fits else "legendonly"),
                  row=1, col=1)
    if fits:
        return max(budget, used)
    fig.add_annotation(text=f"token budget {budget:,} per step (off the scale; busiest step "
                            f"used {used:,})", xref="x domain", yref="y domain", x=1, y=1.08,
                       showarrow=False, font=dict(color="#e45756", size=11), xanchor="right",
                       row=1, col=1)
    return used


def _state_colorscale() -> list[list]:
    """A stepped colorscale: the heatmap's z is a state's index, and each index gets its band
    of one flat colour (a plain colorscale would blend neighbouring states)."""
    n = len(td.STATES)
    scale = []
    for i, name in enumerate(td.STATES):
        scale += [[i / n, td.STATE_COLORS[name]], [(i + 1) / n, td.STATE_COLORS[name]]]
    return scale


def _finished_marks(fig: go.Figure, steps: list[dict], shown: dict[str, Any]) -> None:
    """An x where each shown request finished: the heatmap alone cannot tell a finish from a
    request that is merely not scheduled that step."""
    fin_x, fin_y = [], []
    for i, rec in enumerate(steps):
        for f in rec.get("finished", ()):
            if f["request_id"] in shown:
                fin_x.append(i)
                fin_y.append(f["request_id"])
    fig.add_trace(go.Scatter(x=fin_x, y=fin_y, mode="markers", name="finished",
                             marker=dict(symbol="x-thin", size=9,
                                         line=dict(width=2, color="black"))), row=2, col=1)
