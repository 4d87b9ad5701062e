"""StepTimelineWidget: a profiled run's steps as stacked phases, scrubbable, with each phase's
share beside them (``labkit.engine.profiler``).

The left figure answers "what did step 17 spend its time on?", the right one "what dominates
these steps?". Drag the range slider to one region of a run (the prefill at the start, a stretch
of pure decode, the steps after a burst of arrivals) and the share is recomputed over it: a
phase that is 5% overall can be half of the steps that matter.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.engine.profiler import PHASES, StepProfiler
from labkit.viz.figure_view import FigureView

COLORS = dict(zip(PHASES, ("#4c78a8", "#9ecae9", "#f58518", "#e45756", "#72b7b2", "#54a24b",
                           "#eeca3b", "#b279a2", "#bab0ac")))


def step_rows(source: StepProfiler | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps as dicts (``StepProfile.as_dict``), from a profiler or already as dicts."""
    if isinstance(source, StepProfiler):
        return [s.as_dict() for s in source.steps]
    return list(source)


def timeline_figure(rows: list[dict[str, Any]], lo: int = 0, hi: int | None = None
                    ) -> go.Figure:
    """Stacked milliseconds per phase for steps ``lo..hi`` (inclusive), and the share of each
    phase over those steps."""
    sel = rows[lo:(len(rows) if hi is None else hi + 1)]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3], horizontal_spacing=0.12,
                        subplot_titles=("time per step, by phase", "share over these steps"))
    x = [r["index"] for r in sel]
    total = sum(r["wall"] for r in sel) or 1e-12
    for p in PHASES:
        ms = [1e3 * r["phases"][p] for r in sel]
        fig.add_bar(x=x, y=ms, name=p, marker_color=COLORS[p], legendgroup=p, row=1, col=1,
                    customdata=[[r["num_seqs"], r["num_tokens"]] for r in sel],
                    hovertemplate=f"{p}: %{{y:.3f}} ms<br>step %{{x}}: %{{customdata[0]}} "
                                  "seqs, %{customdata[1]} tokens<extra></extra>")
        fig.add_bar(x=[sum(r["phases"][p] for r in sel) / total], y=[p], orientation="h",
                    marker_color=COLORS[p], legendgroup=p, showlegend=False, row=1, col=2,
                    hovertemplate=f"{p}: %{{x:.1%}}<extra></extra>")
    fig.update_layout(barmode="stack", height=360, width=900, margin={"t": 40},
                      legend={"orientation": "h", "y": -0.18})
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_xaxes(tickformat=".0%", row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    return fig


class StepTimelineWidget(widgets.VBox):
    """``StepTimelineWidget(llm.profiler)``: the figure and a slider choosing the steps."""

    def __init__(self, source: StepProfiler | list[dict[str, Any]]) -> None:
        self.rows = step_rows(source)
        if not self.rows:
            raise ValueError("no profiled steps: run LLM(..., profile=True).generate(...) first")
        n = len(self.rows)
        self.view = FigureView("labkit-step-timeline")
        self.slider = widgets.IntRangeSlider(
            value=(0, n - 1), min=0, max=n - 1, description="steps",
            style={"description_width": "initial"}, layout={"width": "600px"},
            continuous_update=False)
        self.slider.observe(lambda _: self.redraw(), names="value")
        super().__init__([self.slider, self.view])
        self.redraw()

    @property
    def fig(self) -> go.Figure:
        return self.view.figure

    def redraw(self) -> go.Figure:
        lo, hi = self.slider.value
        return self.view.show(timeline_figure(self.rows, lo, hi))
