"""PageTableWidget: the paged KV cache at any engine step, scrubbed with a slider.

PagedAttention's whole idea is an indirection: a sequence's logical blocks map to physical blocks
anywhere in the pool, so memory is allocated a block at a time and identical prefixes can point at
the same physical block. The widget draws both sides of that map: the physical pool (who owns each
block, its ref count, whether it is free or still prefix-cached) and each sequence's block table.
"""

from __future__ import annotations

import math
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView

COLOR_MODES = ("owner", "ref count", "state")
STATE_LEGEND = {"free": td.FREE_COLOR, "prefix-cached (free)": td.CACHED_COLOR,
                "in use": "#4c78a8", "shared (ref > 1)": "#7b3294"}
REF_COLORS = ("#c6dbef", "#6baed6", "#2171b5", "#08306b")  # ref 1, 2, 3, 4+


class PageTableWidget(widgets.VBox):
    """Physical block grid + per-sequence block tables of a trace, with a step slider.

    `trace`: a trace dict, Trace, SimResult or LLMEngine. `tokenizer` (optional) decodes block
    tokens in the hover text. `step` is where the slider starts: by default the step of peak
    KV use (the slider stays free). `max_blocks` / `max_seqs` bound what is drawn for big
    simulations; `max_width` (pixels) is the widest the figure gets (cells shrink to fit, so
    it stays inside a notebook's or a tab's box). `groups` (request id -> label, e.g. the
    LoRA adapter each request runs) colours "owner" by label instead of by request.
    """

    def __init__(self, trace: Any, tokenizer: Any = None, step: int | None = None,
                 color_by: str = "owner", columns: int | None = None,
                 max_blocks: int = 1024, max_seqs: int = 16, max_width: int = 880,
                 groups: dict[str, str] | None = None) -> None:
        if color_by not in COLOR_MODES:
            raise ValueError(f"color_by must be one of {COLOR_MODES}, got {color_by!r}")
        self.tokenizer, self.groups = tokenizer, groups
        self.max_blocks, self.max_seqs, self._columns = max_blocks, max_seqs, columns
        self.max_width = max_width
        self.slider = widgets.IntSlider(description="step", min=0, max=0, continuous_update=False,
                                        layout=widgets.Layout(width="420px"))
        self.prev_button = widgets.Button(description="◀", layout=widgets.Layout(width="40px"),
                                          tooltip="previous step")
        self.next_button = widgets.Button(description="▶", layout=widgets.Layout(width="40px"),
                                          tooltip="next step")
        self.color_by = widgets.ToggleButtons(options=COLOR_MODES, value=color_by,
                                              description="colour by")
        self.summary = widgets.HTML()
        self.legend = widgets.HTML()
        self.view = FigureView("labkit-pagetable-figure")
        self.summary.add_class("labkit-pagetable-summary")
        self.prev_button.on_click(lambda _: self._nudge(-1))
        self.next_button.on_click(lambda _: self._nudge(+1))
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")
        self.color_by.observe(lambda ch: self.show_step(self.slider.value), names="value")
        super().__init__([
            widgets.HBox([self.prev_button, self.slider, self.next_button]),
            self.color_by, self.summary, self.view, self.legend,
        ])
        self.add_class("labkit-pagetable")
        self.set_trace(trace, step)

    # -- public ---------------------------------------------------------------------------
    def set_trace(self, trace: Any, step: int | None = None) -> None:
        """Swap in a new trace (e.g. after a control re-ran the engine); redraw in place at
        `step` (default: peak KV use)."""
        self.trace = td.as_trace_dict(trace)
        meta = self.trace["meta"]
        self.block_size, self.num_blocks = int(meta["block_size"]), int(meta["num_blocks"])
        self.colors = td.request_color(self.trace, self.groups)
        self._build_figure()
        last = len(self.trace["steps"]) - 1
        step = td.peak_step(self.trace) if step is None else step
        with self.slider.hold_trait_notifications():
            self.slider.max = last
            self.slider.value = min(max(step, 0), last)
        self.show_step(self.slider.value)

    def show_step(self, step: int) -> None:
        """Redraw the pool as it was after `step`."""
        state = self.block_state(step)
        grid, table = self._grid_points(state), self._table_points(state)
        fig = go.Figure(self._base)
        g = fig.data[0]
        g.marker.color, g.marker.line.width = grid["color"], grid["line"]
        g.text, g.hovertext = grid["text"], grid["hover"]
        g.textfont.color = ["white" if c not in (td.FREE_COLOR, td.CACHED_COLOR) else "#555"
                            for c in grid["color"]]
        t = fig.data[1]
        t.x, t.y, t.text, t.hovertext = table["x"], table["y"], table["text"], table["hover"]
        t.marker.color, t.marker.line.width = table["color"], table["line"]
        fig.layout.yaxis2.tickvals = list(range(len(table["rows"])))
        fig.layout.yaxis2.ticktext = table["rows"]
        self.figure = self.view.show(fig)
        self.summary.value = self._summary_html(step, state)
        self.legend.value = self._legend_html()

    def block_state(self, step: int) -> dict:
        """Everything drawn at `step`: per physical block its owners, ref count, state, tokens."""
        snap = td.snapshot(self.trace, step)
        tokens = _seq_tokens(self.trace, step)
        owners: dict[int, list[tuple[str, int]]] = {}
        for seq, table in snap.block_tables.items():
            for logical, p in enumerate(table):
                owners.setdefault(p, []).append((seq, logical))
        holders = td.last_holders(self.trace, step)
        return {"snapshot": snap, "owners": owners, "tokens": tokens, "holders": holders,
                "ref": dict(snap.ref_counts), "cached": set(snap.cached)}

    # -- drawing --------------------------------------------------------------------------
    def _nudge(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, 0), self.slider.max)

    def _cols(self) -> int:
        if self._columns:
            return self._columns
        n = min(self.num_blocks, self.max_blocks)
        return 16 if n <= 128 else 32 if n <= 512 else 48

    def _build_figure(self) -> None:
        n = min(self.num_blocks, self.max_blocks)
        cols = self._cols()
        rows = math.ceil(n / cols)
        table_rows = min(self.max_seqs, _max_live_seqs(self.trace))
        width_blocks = max(cols, _max_logical_blocks(self.trace, self.block_size))
        room = self.max_width - 140
        cell = min(28 if cols <= 16 else 16 if cols <= 32 else 11, max(5, room // cols - 6))
        self._table_cell = min(26, max(4, room // width_blocks - 6))
        grid_h = rows * (cell + 4) + 40
        table_h = max(table_rows, 1) * 30 + 40
        fig = make_subplots(rows=2, cols=1, vertical_spacing=0.12,
                            row_heights=[grid_h, table_h],
                            subplot_titles=(f"physical KV blocks (block_size {self.block_size})",
                                            "block tables: logical block → physical block"))
        fig.add_trace(go.Scatter(
            x=[p % cols for p in range(n)], y=[p // cols for p in range(n)], mode="markers+text",
            marker=dict(symbol="square", size=cell, line=dict(color="#222")),
            textfont=dict(size=9, color="white"), hoverinfo="text", name="physical",
            showlegend=False), row=1, col=1)
        fig.add_trace(go.Scatter(
            x=[], y=[], mode="markers+text" if self._table_cell >= 16 else "markers",
            marker=dict(symbol="square", size=self._table_cell, line=dict(color="#222")),
            textfont=dict(size=9, color="white"), hoverinfo="text", name="block table",
            showlegend=False), row=2, col=1)
        fig.update_yaxes(autorange="reversed", showgrid=False, zeroline=False,
                         showticklabels=False, row=1, col=1)
        fig.update_xaxes(showgrid=False, zeroline=False, showticklabels=False, row=1, col=1)
        fig.update_yaxes(autorange="reversed", showgrid=False, zeroline=False, row=2, col=1)
        fig.update_xaxes(title_text="logical block", dtick=1, showgrid=False, zeroline=False,
                         row=2, col=1)
        self._show_ids = cols <= 16
        fig.update_xaxes(range=[-0.6, cols - 0.4], row=1, col=1)
        fig.update_xaxes(range=[-0.6, width_blocks - 0.4], row=2, col=1)
        fig.update_layout(height=grid_h + table_h + 80,
                          width=min(self.max_width, max(560, width_blocks * (self._table_cell + 8)
                                                        + 140, cols * (cell + 6) + 140)),
                          margin=dict(l=70, r=20, t=40, b=40), plot_bgcolor="white")
        self._base = fig

    def _block_color(self, p: int, state: dict) -> str:
        ref = state["ref"].get(p, 0)
        mode = self.color_by.value
        if ref == 0:
            return td.CACHED_COLOR if p in state["cached"] else td.FREE_COLOR
        if mode == "owner":
            seq = state["owners"][p][0][0] if p in state["owners"] else None
            return self.colors.get(td.seq_request(seq), "#4c78a8") if seq else "#4c78a8"
        if mode == "ref count":
            return REF_COLORS[min(ref, len(REF_COLORS)) - 1]
        return STATE_LEGEND["shared (ref > 1)"] if ref > 1 else STATE_LEGEND["in use"]

    def _block_hover(self, p: int, state: dict) -> str:
        ref = state["ref"].get(p, 0)
        owners = state["owners"].get(p, [])
        status = ("free, prefix-cached" if p in state["cached"] else "free") if ref == 0 \
            else f"ref count {ref}"
        lines = [f"<b>physical block {p}</b> — {status}"]
        if owners:
            lines.append("owners: " + ", ".join(f"{s} (logical {lb})" for s, lb in owners))
        holder = owners[0] if owners else state["holders"].get(p)
        if holder and (ref > 0 or p in state["cached"]):
            toks = _block_tokens(state["tokens"], holder, self.block_size)
            if toks is None:
                lines.append("tokens: not recorded (simulated run)")
            else:
                lines.append(f"tokens: {toks}")
                if self.tokenizer is not None and toks:
                    lines.append("text: " + repr(self.tokenizer.decode(toks))[:80])
        return "<br>".join(lines)

    def _grid_points(self, state: dict) -> dict:
        n = min(self.num_blocks, self.max_blocks)
        color, line, text, hover = [], [], [], []
        for p in range(n):
            ref = state["ref"].get(p, 0)
            color.append(self._block_color(p, state))
            line.append(3 if ref > 1 else 0.5)
            text.append(f"{p}×{ref}" if ref > 1 else str(p) if self._show_ids else "")
            hover.append(self._block_hover(p, state))
        return {"color": color, "line": line, "text": text, "hover": hover}

    def _table_points(self, state: dict) -> dict:
        tables = state["snapshot"].block_tables
        order = {rid: i for i, rid in enumerate(self.trace["requests"])}
        seqs = sorted(tables, key=lambda s: (order.get(td.seq_request(s), 1 << 30), s))
        seqs = seqs[: self.max_seqs]
        pts: dict[str, list] = {"x": [], "y": [], "text": [], "hover": [], "color": [],
                                "line": [], "rows": seqs}
        for row, seq in enumerate(seqs):
            for logical, p in enumerate(tables[seq]):
                ref = state["ref"].get(p, 0)
                pts["x"].append(logical)
                pts["y"].append(row)
                pts["text"].append(str(p))
                pts["color"].append(self._block_color(p, state))
                pts["line"].append(3 if ref > 1 else 0.5)
                pts["hover"].append(f"{seq}: logical {logical} → physical {p}<br>"
                                    + self._block_hover(p, state))
        return pts

    def _summary_html(self, step: int, state: dict) -> str:
        rec = self.trace["steps"][step]
        kv = rec.get("kv", {})
        sched = ", ".join(
            f"{s['seq_id']} {s['phase']}{' (chunk)' if s.get('chunked') else ''} "
            f"×{s['num_tokens']}" for s in rec.get("scheduled", ())) or "nothing"
        counts: dict[str, int] = {}
        for ev in rec.get("events", ()):
            counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        events = ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"
        shared = sum(1 for r in state["ref"].values() if r > 1)
        extra = "".join(
            f"; preempted {p['seq_id']} ({p['mode']})" for p in rec.get("preempted", ()))
        extra += "".join(
            f"; finished {f['seq_id']} ({f['reason']})" for f in rec.get("finished", ()))
        cpu = getattr(state["snapshot"], "cpu_block_tables", None) or {}
        if cpu:  # swap preemption parks a sequence's KV in CPU blocks (not drawn in the grid)
            extra += "; swapped to CPU: " + ", ".join(f"{sq} ({len(b)} blocks)"
                                                     for sq, b in cpu.items())
        return (f"<div><b>step {step}</b> (t = {rec['time']:.4f} s) — scheduled: {sched}{extra}"
                f"<br>block events: {events}<br>KV blocks used {kv.get('used', '?')}"
                f" / {kv.get('total', self.num_blocks)}, shared {shared}, prefix-cached free "
                f"{kv.get('cached', len(state['cached']))}, free {kv.get('free', '?')}</div>")

    def _legend_html(self) -> str:
        if self.color_by.value == "owner" and self.groups is not None:
            items = list(td.group_colors(self.groups).items())[:16]
        elif self.color_by.value == "owner":
            items = [(rid, c) for rid, c in list(self.colors.items())[:16]]
        elif self.color_by.value == "ref count":
            items = [(f"ref {i + 1}{'+' if i == 3 else ''}", c) for i, c in enumerate(REF_COLORS)]
        else:
            items = list(STATE_LEGEND.items())
        if self.color_by.value != "state":
            items += [("free", td.FREE_COLOR), ("prefix-cached (free)", td.CACHED_COLOR)]
        chips = "".join(
            f"<span style='display:inline-block;margin-right:10px'><span style='display:inline-"
            f"block;width:12px;height:12px;background:{c};border:1px solid #999;"
            f"vertical-align:middle'></span> {name}</span>" for name, c in items)
        return f"<div>{chips} — thick outline / ×n: a block shared by n sequences</div>"


def _max_live_seqs(trace: dict) -> int:
    best = 1
    for rec in trace["steps"]:
        q = rec.get("queues") or {}
        best = max(best, int(q.get("running", 0)) + int(q.get("swapped", 0)),
                   len(rec.get("scheduled", ())))
    return best


def _max_logical_blocks(trace: dict, block_size: int) -> int:
    longest = max((int(r["prompt_len"]) + int(r.get("max_tokens") or 0)
                   for r in trace["requests"].values()), default=1)
    return min(-(-longest // block_size), 64)


def _seq_tokens(trace: dict, step: int) -> dict[str, list[int] | None]:
    """Token ids of every sequence after `step`: its prompt plus the outputs so far."""
    reqs = trace["requests"]
    toks: dict[str, list[int] | None] = {}
    for rec in trace["steps"][: step + 1]:
        seqs = [s["seq_id"] for s in rec.get("scheduled", ())] + list(rec.get("outputs", {}))
        for seq in seqs:
            if seq not in toks:
                prompt = reqs.get(td.seq_request(seq), {}).get("prompt_token_ids")
                toks[seq] = None if prompt is None else list(prompt)
        for seq, out in rec.get("outputs", {}).items():
            if toks[seq] is not None:
                toks[seq].extend(out)
    return toks


def _block_tokens(tokens: dict, holder: tuple[str, int], block_size: int) -> list[int] | None:
    seq, logical = holder
    seq_toks = tokens.get(seq)
    if seq_toks is None:
        return None
    return seq_toks[logical * block_size:(logical + 1) * block_size]
