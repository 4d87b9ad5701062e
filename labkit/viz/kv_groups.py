"""KVGroupsWidget: a hybrid model's page tables, one per layer group, scrubbed over engine steps.

A model that mixes sliding-window and full layers (gpt-oss 1:1, Gemma 3 5:1) gets one block
table per layer group over one shared pool (:mod:`labkit.kv.hybrid_manager`, vLLM's hybrid KV
cache manager). The full group keeps every block of a sequence; a sliding group hands back each
block whose last token has left the window (:func:`labkit.kv.hybrid.num_skipped_blocks`) and
keeps ``NULL_BLOCK`` in its place, and the freed block can hold any group's next token. One
page table cannot show that, so this widget draws the pool coloured by the group that holds
each block, then one table per group (freed entries drawn hollow), then the blocks each group
holds over the run.

Where the tables come from: :func:`watch_kv_groups` adds a probe to the engine's trace
observer (the seam an MoE model's expert load uses) that copies every live sequence's
``group_block_tables`` after each step, and writes the groups into the trace's ``meta``. The
widget draws those copies: the coordinator's own tables, ``NULL_BLOCK`` entries included. The
pool's reference counts and prefix-cached blocks come from the trace's block events through
the engine's ``replay``, as in :class:`~labkit.viz.page_table.PageTableWidget`.
"""

from __future__ import annotations

import math
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.kv.hybrid import NULL_BLOCK
from labkit.kv.hybrid_manager import group_block_tables
from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView

__all__ = ["PROBE", "KVGroupsWidget", "watch_kv_groups"]

PROBE = "kv_group_tables"  # the trace field: {seq_id: [group 0's table, group 1's, ...]}
GROUP_COLORS = ("#e45756", "#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#9d755d")
NULL_COLOR = "#ffffff"


def _engine(obj: Any) -> Any:
    return getattr(obj, "llm_engine", obj)  # an LLM or an LLMEngine


def watch_kv_groups(llm_or_engine: Any) -> Any:
    """Record each step's per-group block tables into the engine's trace from now on; returns
    the engine. Call it before running the requests the widget should show."""
    eng = _engine(llm_or_engine)
    bm = eng.block_manager
    layout = getattr(bm, "layout", None)
    if layout is None:  # one table for every layer (maybe all sliding with one window)
        w = getattr(bm, "sliding_window", None)
        groups = [{"name": "all layers" if w is None else f"sliding_{w}", "sliding_window": w,
                   "layers": "all"}]
    else:
        groups = [{"name": g.name, "sliding_window": g.sliding_window, "layers": list(g.layers)}
                  for g in layout.groups]
    eng.trace.meta["kv_cache_groups"] = groups
    eng.observer.probes[PROBE] = lambda: {
        sid: [list(t) for t in group_block_tables(s)] for sid, s in bm.seqs.items()}
    return eng


class KVGroupsWidget(widgets.VBox):
    """The pool, one block table per layer group and the blocks each group holds, at any step.

    `trace`: an LLM, LLMEngine, Trace or trace dict recorded under :func:`watch_kv_groups`.
    `step`: where the slider starts (default: the step of peak KV use). `max_seqs` bounds the
    rows of each table; `max_width` (pixels) the figure's width."""

    def __init__(self, trace: Any, step: int | None = None, max_seqs: int = 6,
                 max_width: int = 880, columns: int = 16) -> None:
        self.max_seqs, self.max_width, self.columns = max_seqs, max_width, columns
        self.slider = widgets.IntSlider(description="step", min=0, max=0, continuous_update=False,
                                        layout=widgets.Layout(width="420px"))
        self.prev_button = widgets.Button(description="◀", layout=widgets.Layout(width="40px"),
                                          tooltip="previous step")
        self.next_button = widgets.Button(description="▶", layout=widgets.Layout(width="40px"),
                                          tooltip="next step")
        self.summary = widgets.HTML()
        self.view = FigureView("labkit-kvgroups-figure")
        self.prev_button.on_click(lambda _: self._nudge(-1))
        self.next_button.on_click(lambda _: self._nudge(+1))
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")
        super().__init__([widgets.HBox([self.prev_button, self.slider, self.next_button]),
                          self.summary, self.view])
        self.add_class("labkit-kvgroups")
        self.set_trace(trace, step)

    # -- public ---------------------------------------------------------------------------
    def set_trace(self, trace: Any, step: int | None = None) -> None:
        """Swap in a run recorded under :func:`watch_kv_groups`; redraw at `step`."""
        t = td.as_trace_dict(trace if isinstance(trace, dict) else _engine(trace))
        self.groups = t["meta"].get("kv_cache_groups")
        if not self.groups or any(PROBE not in rec for rec in t["steps"]):
            raise ValueError("this trace has no per-group block tables: call "
                             "labkit.viz.kv_groups.watch_kv_groups(llm) before running the "
                             "requests, then build the widget")
        self.trace = t
        meta = t["meta"]
        self.block_size, self.num_blocks = int(meta["block_size"]), int(meta["num_blocks"])
        self.held_over_steps = [self.held(i) for i in range(len(t["steps"]))]
        self._build_figure()
        last = len(t["steps"]) - 1
        step = td.peak_step(t) if step is None else step
        with self.slider.hold_trait_notifications():
            self.slider.max = last
            self.slider.value = min(max(step, 0), last)
        self.show_step(self.slider.value)

    def group_tables(self, step: int) -> dict[str, list[list[int]]]:
        """seq_id -> its block table in each group after `step` (``NULL_BLOCK`` = freed)."""
        return self.trace["steps"][step][PROBE]

    def held(self, step: int) -> list[int]:
        """Blocks each group holds after `step`, over every sequence (freed entries aside)."""
        out = [0] * len(self.groups)
        for tables in self.group_tables(step).values():
            for g, table in enumerate(tables):
                out[g] += sum(b != NULL_BLOCK for b in table)
        return out

    def show_step(self, step: int) -> None:
        """Redraw everything as it was after `step`."""
        snap = td.snapshot(self.trace, step)
        tables = self.group_tables(step)
        fig = go.Figure(self._base)
        owner = {b: g for ts in tables.values() for g, t in enumerate(ts) for b in t
                 if b != NULL_BLOCK}
        self._draw_pool(fig.data[0], owner, snap)
        for g in range(len(self.groups)):
            self._draw_table(fig.data[1 + g], g, tables)
        fig.data[-1].x, fig.data[-1].y = [step, step], [0, max(map(max, self.held_over_steps))]
        self.figure = self.view.show(fig)
        self.summary.value = self._summary_html(step, snap)

    # -- drawing --------------------------------------------------------------------------
    def _nudge(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, 0), self.slider.max)

    def _seq_order(self) -> list[str]:
        order = {rid: i for i, rid in enumerate(self.trace["requests"])}
        seqs = {s for rec in self.trace["steps"] for s in rec[PROBE]}
        return sorted(seqs, key=lambda s: (order.get(td.seq_request(s), 1 << 30), s))

    def _build_figure(self) -> None:
        G, cols = len(self.groups), self.columns
        grid_rows = math.ceil(self.num_blocks / cols)
        self._rows = self._seq_order()[: self.max_seqs]
        width = max((len(t) for rec in self.trace["steps"] for ts in rec[PROBE].values()
                     for t in ts), default=1)
        titles = [f"one pool of {self.num_blocks} blocks (block_size {self.block_size}), "
                  "coloured by the group holding each block"]
        titles += [f"group {g}: {d['name']} — block tables (logical → physical; hollow: freed)"
                   for g, d in enumerate(self.groups)]
        titles.append("blocks each group holds, per step")
        heights = [grid_rows * 26 + 30] + [len(self._rows) * 26 + 40] * G + [170]
        fig = make_subplots(rows=G + 2, cols=1, vertical_spacing=0.35 / (G + 2),
                            row_heights=heights, subplot_titles=titles)
        cell = min(24, max(8, (self.max_width - 140) // max(cols, width) - 6))
        fig.add_trace(_cells([p % cols for p in range(self.num_blocks)],
                             [p // cols for p in range(self.num_blocks)], cell), row=1, col=1)
        for g in range(G):
            fig.add_trace(_cells([], [], cell), row=g + 2, col=1)
            fig.update_yaxes(tickvals=list(range(len(self._rows))), ticktext=self._rows,
                             row=g + 2, col=1)
            fig.update_xaxes(range=[-0.6, max(width, cols) - 0.4], dtick=1, row=g + 2, col=1)
        for g, d in enumerate(self.groups):
            fig.add_trace(go.Scatter(x=list(range(len(self.held_over_steps))),
                                     y=[h[g] for h in self.held_over_steps], mode="lines",
                                     name=f"group {g}: {d['name']}",
                                     line=dict(color=_color(g))),
                          row=G + 2, col=1)
        fig.add_trace(go.Scatter(x=[0, 0], y=[0, 1], mode="lines", showlegend=False,
                                 line=dict(color="#888", dash="dot"), hoverinfo="skip"),
                      row=G + 2, col=1)
        for r in range(1, G + 2):
            fig.update_yaxes(autorange="reversed", showgrid=False, zeroline=False, row=r, col=1)
            fig.update_xaxes(showgrid=False, zeroline=False, row=r, col=1)
        fig.update_yaxes(showticklabels=False, row=1, col=1)
        fig.update_xaxes(showticklabels=False, range=[-0.6, cols - 0.4], row=1, col=1)
        fig.update_xaxes(title_text="engine step", row=G + 2, col=1)
        fig.update_layout(height=sum(heights) + 60 * (G + 2), width=self.max_width,
                          margin=dict(l=90, r=20, t=40, b=40), plot_bgcolor="white",
                          legend=dict(orientation="h", y=-0.02))
        self._base = fig

    def _draw_pool(self, trace: Any, owner: dict[int, int], snap: Any) -> None:
        colors, text, hover = [], [], []
        for p in range(self.num_blocks):
            if p in owner:
                g = owner[p]
                colors.append(_color(g))
                hover.append(f"block {p}: group {g} ({self.groups[g]['name']}), "
                             f"ref {snap.ref_counts.get(p, 0)}")
            else:
                cached = p in snap.cached
                colors.append(td.CACHED_COLOR if cached else td.FREE_COLOR)
                hover.append(f"block {p}: free{', prefix-cached' if cached else ''}")
            text.append(str(p))
        trace.marker.color, trace.text, trace.hovertext = colors, text, hover

    def _draw_table(self, trace: Any, g: int, tables: dict[str, list[list[int]]]) -> None:
        x, y, colors, text, hover = [], [], [], [], []
        for row, seq in enumerate(self._rows):
            for logical, p in enumerate(tables.get(seq, [[]] * len(self.groups))[g]):
                x.append(logical)
                y.append(row)
                freed = p == NULL_BLOCK
                colors.append(NULL_COLOR if freed else _color(g))
                text.append("" if freed else str(p))
                hover.append(f"{seq}, group {g}: logical {logical} → "
                             + ("freed (outside the window)" if freed else f"physical {p}"))
        trace.x, trace.y, trace.text, trace.hovertext = x, y, text, hover
        trace.marker.color = colors

    def _summary_html(self, step: int, snap: Any) -> str:
        rec = self.trace["steps"][step]
        sched = ", ".join(f"{s['seq_id']} {s['phase']} ×{s['num_tokens']}"
                          for s in rec.get("scheduled", ())) or "nothing"
        held = self.held(step)
        freed = [sum(t[g].count(NULL_BLOCK) for t in self.group_tables(step).values())
                 for g in range(len(self.groups))]
        parts = "; ".join(f"<span style='color:{_color(g)}'>■</span> group {g} {d['name']}: "
                          f"holds {held[g]}, freed {freed[g]}" for g, d in enumerate(self.groups))
        kv = rec.get("kv", {})
        return (f"<div><b>step {step}</b> — scheduled: {sched}<br>{parts}<br>pool: used "
                f"{kv.get('used', '?')} / {kv.get('total', self.num_blocks)}, prefix-cached "
                f"free {len(snap.cached)}</div>")


def _color(g: int) -> str:
    return GROUP_COLORS[g % len(GROUP_COLORS)]


def _cells(x: list[int], y: list[int], size: int) -> go.Scatter:
    return go.Scatter(x=x, y=y, mode="markers+text", hoverinfo="text", showlegend=False,
                      marker=dict(symbol="square", size=size, line=dict(color="#222", width=1)),
                      textfont=dict(size=8, color="#222"))
