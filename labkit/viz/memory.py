"""MemoryWidget: KV cache usage over an engine run — paged against contiguous pre-allocation.

Before PagedAttention, servers reserved a contiguous KV region of prompt + max_tokens slots per
request when it was admitted, so most of the memory held nothing (the vLLM paper measured
20-38% of it holding real token state). Paging allocates a block at a time: the only waste is the
unfilled tail of each sequence's last block. The widget draws, at every step, the token slots
really holding KV, the blocks paging allocated, and what the contiguous scheme would have
reserved for the same running requests, against the pool size and the admission watermarks.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView


def memory_series(trace: Any) -> dict[str, list[float]]:
    """Per step, in KV token slots: held by sequences (shared blocks count once per sequence),
    paged (allocated blocks × block_size), paged
    including free-but-prefix-cached blocks, and contiguous reservation (prompt + max_tokens of
    every request holding KV)."""
    trace = td.as_trace_dict(trace)
    bs = int(trace["meta"]["block_size"])
    rids, states = td.request_states(trace)
    holding = {"prefill", "chunked prefill", "decode", "waiting"}
    started: set[str] = set()
    out: dict[str, list[float]] = {"step": [], "time": [], "tokens": [], "paged": [],
                                   "paged+cached": [], "contiguous": []}
    for i, rec in enumerate(trace["steps"]):
        kv = rec.get("kv", {})
        reserve = 0
        for rid, row in zip(rids, states):
            st = row[i]
            if st in ("prefill", "chunked prefill", "decode"):
                started.add(rid)
            if st is None or st == "preempted" or rid not in started or st not in holding:
                continue
            req = trace["requests"][rid]
            reserve += int(req.get("n") or 1) * (int(req["prompt_len"]) + int(req["max_tokens"]))
        out["step"].append(rec["step"])
        out["time"].append(float(rec["time"]))
        out["tokens"].append(kv.get("token_slots_used", 0))
        out["paged"].append(kv.get("used", 0) * bs)
        out["paged+cached"].append((kv.get("used", 0) + kv.get("cached", 0)) * bs)
        out["contiguous"].append(reserve)
    return out


class MemoryWidget(widgets.VBox):
    """KV usage over time, paged vs contiguous, with pool capacity and watermarks."""

    def __init__(self, trace: Any, x: str = "step") -> None:
        if x not in ("step", "time"):
            raise ValueError(f"x must be 'step' or 'time', got {x!r}")
        self.x = x
        self.view = FigureView("labkit-memory-figure")
        self.summary = widgets.HTML()
        super().__init__([self.summary, self.view])
        self.add_class("labkit-memory")
        self.set_trace(trace)

    def set_trace(self, trace: Any) -> None:
        self.trace = td.as_trace_dict(trace)
        meta = self.trace["meta"]
        s = memory_series(self.trace)
        capacity = int(meta["num_blocks"]) * int(meta["block_size"])
        xs = s[self.x]
        fig = go.Figure()
        at = "step %{x}" if self.x == "step" else "at %{x:.2f} s"
        for key, name, line, fill, says in (
                ("contiguous", "contiguous reservation (prompt + max_tokens)",
                 dict(color="#e45756", dash="dot"), None,
                 "contiguous pre-allocation would reserve %{y:,} token slots"),
                ("paged+cached", "paged + prefix-cached blocks", dict(color=td.CACHED_COLOR),
                 None, "allocated and prefix-cached blocks span %{y:,} token slots"),
                ("paged", "paged: allocated blocks", dict(color="#4c78a8"), "tozeroy",
                 "paging has allocated blocks for %{y:,} token slots"),
                ("tokens", "token slots holding KV", dict(color="#54a24b"), "tozeroy",
                 "%{y:,} token slots hold KV")):
            fig.add_trace(go.Scatter(x=xs, y=s[key], name=name, line=line, fill=fill,
                                     hovertemplate=f"{at}: {says}.<extra></extra>"))
        fig.add_hline(y=capacity, line=dict(color="black"), annotation_text="KV pool capacity")
        # Watermark admission (labkit.sched): at KV usage >= watermark_high no new request is
        # admitted until usage falls to watermark_low. 1.0 means off.
        labels = {"watermark_high": "stop admitting at", "watermark_low": "resume admitting at"}
        for key, text in labels.items():
            w = meta.get(key)
            if w is not None and 0 < float(w) < 1:
                fig.add_hline(y=capacity * float(w), line=dict(color="grey", dash="dash"),
                              annotation_text=f"{key}: {text} {float(w):.0%}",
                              annotation_position="bottom right")
        fig.update_layout(height=380, width=820, plot_bgcolor="white",
                          xaxis_title="engine step" if self.x == "step" else "time (s)",
                          yaxis_title="KV token slots", legend=dict(orientation="h", y=-0.25),
                          margin=dict(l=60, r=20, t=30, b=40))
        self.figure = self.view.show(fig)
        self.summary.value = _summary(s, capacity)


def _summary(s: dict, capacity: int) -> str:
    tok, paged, contig = sum(s["tokens"]), sum(s["paged"]), sum(s["contiguous"])
    if not paged:
        return "<div>no KV was allocated in this trace</div>"
    peak = max(s["contiguous"]) if s["contiguous"] else 0
    contig_use = f"{tok / contig:.0%}" if contig else "n/a"
    return (f"<div>Token KV held per reserved slot, summed over steps: paged <b>{tok / paged:.0%}"
            f"</b> (the rest are last-block tails; above 100% means prefix blocks are shared) vs "
            f"contiguous pre-allocation <b>{contig_use}</b>. Contiguous peak: {peak} slots = "
            f"{peak / capacity:.0%} of the pool.</div>")
