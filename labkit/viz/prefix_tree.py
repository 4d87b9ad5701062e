"""PrefixTreeWidget: the prefix cache as the radix tree it implicitly is.

Block hashes chain each block to everything before it, so the set of cached blocks forms a tree:
the root's children are distinct first blocks, and two prompts share a path exactly as long as
they share whole blocks of tokens (SGLang's RadixAttention keeps this tree explicitly; vLLM's hash
chain stores the same tree as a flat dict). The widget rebuilds that tree at any step from the
trace — each node one physical block, in use by running sequences or free but still cached.
"""

from __future__ import annotations

from html import escape
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.viz import tracedata as td
from labkit.viz.figure_view import FigureView
from labkit.viz.page_table import _seq_tokens

IN_USE, SHARED = "#4c78a8", "#7b3294"


def prefix_tree(trace: Any, step: int) -> list[dict]:
    """Live blocks after `step` as tree nodes: id, parent ('' = root), physical block, the seq
    and logical index that last wrote it, ref count and state ('in use' | 'cached').

    A node is one allocation of a physical block (a re-allocated block is a new node); its parent
    is the node of the same sequence's previous logical block when it was mapped.
    """
    trace = td.as_trace_dict(trace)
    snap = td.snapshot(trace, step)
    gen: dict[int, int] = {}            # physical -> allocation generation
    node_of: dict[tuple[str, int], str] = {}  # (seq, logical) -> node id
    nodes: dict[str, dict] = {}
    for rec in trace["steps"][: step + 1]:
        for ev in rec.get("events", ()):
            kind, seq, lg, p = ev["type"], ev["seq_id"], ev["logical"], ev["physical"]
            if kind in ("alloc", "cow", "swap_in"):
                gen[p] = gen.get(p, 0) + 1
            if kind in ("alloc", "cow", "swap_in", "prefix_hit", "fork"):
                nid = f"b{p}.{gen.get(p, 0)}"
                node_of[(seq, lg)] = nid
                if nid not in nodes:
                    parent = node_of.get((seq, lg - 1), "") if lg > 0 else ""
                    nodes[nid] = {"id": nid, "parent": parent, "physical": p, "seq_id": seq,
                                  "logical": lg}
    live = []
    for nid, n in nodes.items():
        p = n["physical"]
        if nid != f"b{p}.{gen.get(p, 0)}":
            continue  # the physical block was evicted and reused since
        ref = snap.ref_counts.get(p, 0)
        if ref == 0 and p not in snap.cached:
            continue  # freed without being cached
        live.append({**n, "ref": ref, "state": "in use" if ref else "cached"})
    ids = {n["id"] for n in live}
    for n in live:  # a parent evicted before its child keeps the child at the root
        if n["parent"] not in ids:
            n["parent"] = ""
    return live


class PrefixTreeWidget(widgets.VBox):
    """Icicle chart of the cached prefix tree at a step, with a step slider (starting, by
    default, where the most blocks are in use or cached)."""

    def __init__(self, trace: Any, tokenizer: Any = None, step: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.trace = td.as_trace_dict(trace)
        self.block_size = int(self.trace["meta"]["block_size"])
        last = len(self.trace["steps"]) - 1
        self.slider = widgets.IntSlider(description="step", min=0, max=last,
                                        value=td.peak_step(self.trace, cached=True)
                                        if step is None else step,
                                        layout=widgets.Layout(width="420px"))
        self.summary = widgets.HTML()
        self.view = FigureView("labkit-prefixtree-figure")
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")
        super().__init__([self.slider, self.summary, self.view])
        self.add_class("labkit-prefixtree")
        self.show_step(self.slider.value)

    def _label(self, toks: list[int] | None) -> str:
        if toks is None:
            return "?"
        if self.tokenizer is not None:
            return repr(self.tokenizer.decode(toks))[1:-1][:24]
        return " ".join(map(str, toks))[:24]

    def show_step(self, step: int) -> None:
        nodes = prefix_tree(self.trace, step)
        tokens = _seq_tokens(self.trace, step)
        ids, parents, labels, colors, hover = ["root"], [""], ["(start)"], ["white"], ["root"]
        for n in nodes:
            seq_toks = tokens.get(n["seq_id"])
            toks = None if seq_toks is None else seq_toks[
                n["logical"] * self.block_size:(n["logical"] + 1) * self.block_size]
            ids.append(n["id"])
            parents.append(n["parent"] or "root")
            labels.append(self._label(toks))
            colors.append(td.CACHED_COLOR if n["state"] == "cached"
                          else SHARED if n["ref"] > 1 else IN_USE)
            hover.append(f"physical block {n['physical']} ({n['state']}, ref {n['ref']})<br>"
                         f"tokens {toks}")
        fig = go.Figure(go.Icicle(ids=ids, parents=parents, labels=labels, hovertext=hover,
                                  hoverinfo="text", marker=dict(colors=colors),
                                  tiling=dict(orientation="h"), root=dict(color="white")))
        fig.update_layout(height=360, width=900, margin=dict(l=10, r=10, t=10, b=10))
        self.figure = self.view.show(fig)
        cached = sum(1 for n in nodes if n["state"] == "cached")
        roots = sum(1 for n in nodes if not n["parent"])
        self.summary.value = (
            f"<div><b>step {step}</b>: {len(nodes)} live blocks ({cached} cached, free for "
            f"reuse), {roots} distinct first blocks. Colours: <span style='color:{IN_USE}'>"
            f"in use</span>, <span style='color:{SHARED}'>shared</span>, <span style='color:"
            f"{escape(td.CACHED_COLOR)}'>cached</span>.</div>")
