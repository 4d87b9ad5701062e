"""Routing made visible: expert load per layer and step, and which expert each token chose.

A mixture of experts is only as fast as its busiest expert: with expert parallelism each GPU
holds some experts, and the step waits for the one whose experts got the most tokens. So the
first question about an MoE is *how evenly does the router spread the load?* Two views answer it:

* :class:`ExpertLoadWidget`: a heatmap of tokens routed to each expert (layer x expert) in one
  engine step, read from the trace's ``expert_load`` records (:class:`labkit.model.moe.
  ExpertLoadProbe`), with a slider over the steps and the step's imbalance (max / mean load per
  layer: 1.0 is perfect balance, E/k the worst a top-k router can do).
* :class:`TokenRoutingWidget`: the tokens of one prompt, coloured by their top-1 expert, one row
  per MoE layer, from ``labkit.model.moe.routing(model)`` after a forward over the prompt.
"""

from __future__ import annotations

from html import escape
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView

#: one colour per expert (plotly's qualitative "Plotly" then "D3" palettes: 20 distinct)
EXPERT_COLORS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692",
                 "#b6e880", "#ff97ff", "#fecb52", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                 "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def expert_load_series(trace: Any) -> dict[str, Any]:
    """The trace's expert load: ``steps`` (engine steps that ran a forward), ``layers`` (the MoE
    layers, the rows) and ``load`` [step][layer][expert] token counts, as recorded."""
    trace = td.as_trace_dict(trace)
    layers = trace["meta"].get("moe_layers")
    if not layers:
        raise ValueError("trace has no MoE layers (trace.meta['moe_layers']): run the engine "
                         "on a mixture-of-experts model")
    steps, load = [], []
    for rec in trace["steps"]:
        if rec.get("expert_load") is None:
            continue
        if len(rec["expert_load"]) != len(layers):
            raise ValueError(f"step {rec['step']}: expert_load has {len(rec['expert_load'])} "
                             f"rows, the trace names {len(layers)} MoE layers")
        steps.append(rec["step"])
        load.append(rec["expert_load"])
    if not steps:
        raise ValueError("no step of the trace recorded expert_load")
    return {"steps": steps, "layers": list(layers), "load": load}


def imbalance(row: list[int]) -> float:
    """max / mean of one layer's load (1.0: perfectly balanced; 0 tokens: 1.0)."""
    total = sum(row)
    return max(row) * len(row) / total if total else 1.0


class ExpertLoadWidget(widgets.VBox):
    """Heatmap of expert load (layer x expert) for one engine step, scrubbed with a slider.

    `trace`: a trace dict, Trace or LLMEngine of an MoE model. `step` is where the slider starts
    (default: the step that routed the most tokens, usually the prefill)."""

    def __init__(self, trace: Any, step: int | None = None) -> None:
        self.view = FigureView("labkit-moe-load-figure")
        self.slider = widgets.SelectionSlider(description="step", options=[0],
                                              continuous_update=False,
                                              layout=widgets.Layout(width="420px"))
        self.summary = widgets.HTML()
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")
        super().__init__([self.summary, self.slider, self.view])
        self.add_class("labkit-moe-load")
        self.set_trace(trace, step)

    def set_trace(self, trace: Any, step: int | None = None) -> None:
        """Swap in a new trace and redraw at `step` (default: the busiest step)."""
        self.trace = td.as_trace_dict(trace)
        self.series = s = expert_load_series(self.trace)
        self.num_experts = len(s["load"][0][0])
        busiest = max(range(len(s["steps"])), key=lambda i: sum(map(sum, s["load"][i])))
        start = s["steps"][busiest] if step is None else step
        if start not in s["steps"]:
            raise ValueError(f"step {start} recorded no expert load; steps with a forward: "
                             f"{s['steps'][:8]}...")
        with self.slider.hold_trait_notifications():
            self.slider.options = s["steps"]
            self.slider.value = start
        self.show_step(start)

    def load_at(self, step: int) -> list[list[int]]:
        """The load drawn at engine step `step`: [MoE layer][expert] token counts."""
        return self.series["load"][self.series["steps"].index(step)]

    def show_step(self, step: int) -> None:
        """Redraw the heatmap for engine step `step`."""
        load = self.load_at(step)
        layers = [f"layer {i}" for i in self.series["layers"]]
        fig = go.Figure(go.Heatmap(
            z=load, x=[f"expert {e}" for e in range(self.num_experts)], y=layers,
            colorscale="Blues", zmin=0, text=load, texttemplate="%{text}",
            colorbar=dict(title="tokens"),
            hovertemplate="%{y}, %{x}: %{z} tokens<extra></extra>"))
        fig.update_layout(title=f"expert load at step {step}", height=90 + 36 * len(layers),
                          width=720, yaxis=dict(autorange="reversed"),
                          margin=dict(l=80, r=30, t=50, b=40))
        self.figure = self.view.show(fig)
        worst = max(imbalance(r) for r in load)
        self.summary.value = (f"<div>step {step}: {sum(load[0])} routing slots per layer "
                              f"(tokens x top-k); worst imbalance <b>{worst:.2f}</b> "
                              "(max / mean load, 1.00 = even)</div>")


def top1_experts(routes: dict[int, Any]) -> dict[int, list[int]]:
    """Layer -> top-1 expert of each token, from ``labkit.model.moe.routing(model)``."""
    if not routes:
        raise ValueError("no routing recorded: run a forward of an MoE model first")
    return {i: r.topk_ids[:, 0].tolist() for i, r in sorted(routes.items())}


class TokenRoutingWidget(widgets.VBox):
    """The tokens of one prompt coloured by their top-1 expert, one row per MoE layer.

    `routes`: ``routing(model)`` right after a forward over exactly `token_ids` (one sequence).
    `tokenizer` (optional) decodes the tokens for the labels."""

    def __init__(self, routes: dict[int, Any], token_ids: list[int],
                 tokenizer: Any = None) -> None:
        self.top1 = top1_experts(routes)
        n = len(token_ids)
        for i, ids in self.top1.items():
            if len(ids) != n:
                raise ValueError(f"layer {i} routed {len(ids)} tokens, the prompt has {n}: "
                                 "pass routing(model) of a forward over this prompt alone")
        self.num_experts = next(iter(routes.values())).router_logits.shape[-1]
        self.labels = [tokenizer.decode([t]) if tokenizer else str(t) for t in token_ids]
        self.view = FigureView("labkit-moe-tokens-figure")
        self.layer = widgets.Dropdown(options=list(self.top1), description="layer")
        self.tokens = widgets.HTML()
        self.layer.observe(lambda ch: self.show_layer(ch["new"]), names="value")
        super().__init__([self.view, self.layer, self.tokens])
        self.add_class("labkit-moe-tokens")
        self._draw()
        self.show_layer(self.layer.value)

    def _draw(self) -> None:
        E, rows = self.num_experts, list(self.top1)
        colors = [EXPERT_COLORS[e % len(EXPERT_COLORS)] for e in range(E)]
        scale = [[v, c] for e, c in enumerate(colors) for v in (e / E, (e + 1) / E)]
        x = [f"{j}:{lab!r}" for j, lab in enumerate(self.labels)]
        fig = go.Figure(go.Heatmap(
            z=[self.top1[i] for i in rows], x=x, y=[f"layer {i}" for i in rows],
            zmin=-0.5, zmax=E - 0.5, colorscale=scale, xgap=1, ygap=1,
            colorbar=dict(title="top-1 expert", tickvals=list(range(E))),
            hovertemplate="%{y}, token %{x}: expert %{z}<extra></extra>"))
        fig.update_layout(title="top-1 expert of each token", width=min(900, 160 + 22 * len(x)),
                          height=110 + 30 * len(rows), yaxis=dict(autorange="reversed"),
                          xaxis=dict(tickangle=-60, tickfont=dict(size=9)),
                          margin=dict(l=80, r=30, t=50, b=90))
        self.figure = self.view.show(fig)

    def show_layer(self, layer: int) -> None:
        """The prompt as text, each token on its top-1 expert's colour in `layer`."""
        chips = []
        for lab, e in zip(self.labels, self.top1[layer]):
            c = EXPERT_COLORS[e % len(EXPERT_COLORS)]
            chips.append(f"<span title='expert {e}' style='background:{c};color:white;"
                         f"padding:1px 2px;margin:1px;font-family:monospace;"
                         f"white-space:pre'>{escape(lab)}</span>")
        self.tokens.value = f"<div><b>layer {layer}</b>: {''.join(chips)}</div>"
