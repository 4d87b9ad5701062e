"""SpecWidget: speculative decoding step by step — which draft tokens the target accepted.

Each step the draft model proposes γ tokens; the target verifies all of them in one forward pass
and keeps the longest prefix the rejection-sampling rule accepts (plus one token of its own). The
speed-up hinges on the acceptance rate α: the expected tokens per target pass is
(1 - α^(γ+1)) / (1 - α). The widget plots accepted vs rejected draft tokens per step, the
running acceptance rate, and, for a chosen step, the proposed tokens coloured by their fate.
"""

from __future__ import annotations

from html import escape
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView


def spec_series(trace: Any) -> dict[str, list]:
    """Per step with speculation: proposed, accepted and rejected draft tokens, summed over
    sequences, and the cumulative acceptance rate (accepted / proposed)."""
    trace = td.as_trace_dict(trace)
    out: dict[str, list] = {"step": [], "proposed": [], "accepted": [], "rejected": [],
                            "rate": []}
    tot_p = tot_a = 0
    for rec in trace["steps"]:
        entries = rec.get("spec") or []
        if not entries:
            continue
        p = sum(len(e["proposed"]) for e in entries)
        a = sum(int(e["accepted"]) for e in entries)
        if a > p or a < 0:
            raise ValueError(f"step {rec['step']}: accepted {a} outside 0..proposed {p}")
        tot_p, tot_a = tot_p + p, tot_a + a
        out["step"].append(rec["step"])
        out["proposed"].append(p)
        out["accepted"].append(a)
        out["rejected"].append(p - a)
        out["rate"].append(tot_a / tot_p if tot_p else 0.0)
    return out


class SpecWidget(widgets.VBox):
    """Accepted / rejected draft tokens per step, acceptance rate, and a per-step token view."""

    def __init__(self, trace: Any, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.view = FigureView("labkit-spec-figure")
        self.slider = widgets.SelectionSlider(description="step", options=[0],
                                              layout=widgets.Layout(width="420px"))
        self.tokens = widgets.HTML()
        self.summary = widgets.HTML()
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")
        super().__init__([self.summary, self.view, self.slider, self.tokens])
        self.add_class("labkit-spec")
        self.set_trace(trace)

    def set_trace(self, trace: Any) -> None:
        self.trace = td.as_trace_dict(trace)
        s = spec_series(self.trace)
        if not s["step"]:
            raise ValueError("trace has no speculative steps: run the engine with a "
                             "speculative_config")
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        fig.add_trace(go.Bar(x=s["step"], y=s["accepted"], name="accepted",
                             marker_color="#54a24b"))
        fig.add_trace(go.Bar(x=s["step"], y=s["rejected"], name="rejected",
                             marker_color="#e45756"))
        fig.add_trace(go.Scatter(x=s["step"], y=s["rate"], name="acceptance rate (cumulative)",
                                 line=dict(color="black")), secondary_y=True)
        fig.update_layout(barmode="stack", height=340, width=820, plot_bgcolor="white",
                          xaxis_title="engine step", legend=dict(orientation="h", y=1.12),
                          margin=dict(l=50, r=50, t=30, b=40))
        fig.update_yaxes(title_text="draft tokens", secondary_y=False)
        fig.update_yaxes(title_text="acceptance rate", range=[0, 1.05], dtick=0.2,
                         tickformat=".0%", showgrid=False, secondary_y=True)
        self.figure = self.view.show(fig)
        self._spec_steps = s["step"]
        rate = s["rate"][-1]
        self.summary.value = (f"<div>{sum(s['proposed'])} draft tokens proposed over "
                              f"{len(s['step'])} steps, {sum(s['accepted'])} accepted: draft "
                              f"acceptance rate <b>{rate:.1%}</b></div>")
        self.slider.options = self._spec_steps  # resets the value to the first option
        self.show_step(self._spec_steps[0])

    def show_step(self, step: int) -> None:
        """Show the draft tokens of engine step `step` (one that speculated)."""
        rec = next(r for r in self.trace["steps"] if r["step"] == step)
        lines = []
        for e in rec["spec"]:
            chips = []
            for j, tok in enumerate(e["proposed"]):
                ok = j < int(e["accepted"])
                label = escape(repr(self.tokenizer.decode([tok]))) if self.tokenizer else tok
                style = ("background:#c7e9c0" if ok else
                         "background:#fcbba1;text-decoration:line-through")
                chips.append(f"<span style='{style};padding:1px 4px;margin:1px;"
                             f"font-family:monospace'>{label}</span>")
            lines.append(f"<div>{escape(e['seq_id'])}: {''.join(chips)} — accepted "
                         f"{e['accepted']}/{len(e['proposed'])}</div>")
        self.tokens.value = f"<div><b>step {step}</b></div>" + "".join(lines)
