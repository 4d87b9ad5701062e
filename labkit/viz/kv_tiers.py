"""KV beyond one engine, made visible: the connector's calls step by step, and the tiers filling.

A tiered prefix cache (:class:`labkit.kv.connector.OffloadingConnector`) works in two places a
learner cannot see from outputs alone: at admission (how many prompt tokens each tier supplies)
and around the forward (which device blocks are loaded from which tier, which are saved). Two
views:

* :func:`trace_connector` wraps one connector *instance* (as ``attach_layer_hooks`` wraps one
  cache) and records, per engine step, the loads (device block <- tier) and saves (device block
  -> key) its metadata carried, and per admission the matched tokens. :func:`connector_table`
  renders that as rows a notebook prints.
* :class:`KVTierWidget`: runs a list of requests one by one through an engine with such a
  connector ("next request" / "run all") and redraws, after each, what each tier holds (blocks)
  and how many prompt tokens each tier has supplied so far: the hits climbing as prefixes come
  back after the device pool has evicted them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.viz.figure_view import FigureView

TIER_COLORS = {"device": "#636efa", "cpu": "#00cc96", "disk": "#ffa15a"}


def trace_connector(connector: Any) -> list[dict[str, Any]]:
    """Record the connector's per-step work into the returned list (kept up to date): one
    ``{"kind": "admit", "seq", "computed", "matched"}`` per admission and one ``{"kind":
    "step", "loads": [(block, tier)], "saves": [block]}`` per step that moved a block."""
    log: list[dict[str, Any]] = []
    match, build = connector.get_num_new_matched_tokens, connector.build_connector_meta

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> int:
        n = match(request, num_computed_tokens)
        log.append({"kind": "admit", "seq": request.seq_id, "computed": num_computed_tokens,
                    "matched": n})
        return n

    def build_connector_meta(scheduler_output: Any) -> Any:
        meta = build(scheduler_output)
        loads = [(b, tier) for b, tier, _ in getattr(meta, "loads", [])]
        saves = [b for b, _ in getattr(meta, "saves", [])]
        if loads or saves:
            log.append({"kind": "step", "loads": loads, "saves": saves})
        return meta

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.build_connector_meta = build_connector_meta
    return log


def connector_table(log: Sequence[dict[str, Any]], block_size: int) -> list[str]:
    """One line per recorded event, in order (what the notebook prints)."""
    lines = []
    for e in log:
        if e["kind"] == "admit":
            lines.append(f"admit {e['seq']}: {e['computed']} tokens cached on the device, "
                         f"{e['matched']} more from the tiers ({e['matched'] // block_size} "
                         "blocks)")
        else:
            loads = ", ".join(f"{b}<-{t}" for b, t in e["loads"]) or "-"
            lines.append(f"  step: load {loads}; save blocks {e['saves'] or '-'}")
    return lines


def tier_state(engine: Any) -> dict[str, dict[str, int]]:
    """Blocks each tier holds now and the prompt tokens each has supplied so far."""
    conn = engine.kv_connector
    stats = conn.stats()
    bs = engine.config.cache.block_size
    pool = engine.block_manager.pool
    held = {"device": int(pool.num_cached) if hasattr(pool, "num_cached")
            else len(getattr(pool, "hash_to_block", {}))}
    for tier in ("cpu", "disk"):
        if tier in stats:
            held[tier] = int(stats[tier].get("blocks", 0))
    hits = {t: int(stats[t].get("hits", 0)) * bs for t in held if t in stats}
    return {"blocks": held, "hit_tokens": hits}


class KVTierWidget(widgets.VBox):
    """Requests through ``llm`` (an ``LLM`` whose engine has an offloading connector) one at a
    time; each press redraws the tiers (see the module doc). ``requests``: (prompt ids, params)."""

    def __init__(self, llm: Any, requests: Sequence[tuple[list[int], Any]]) -> None:
        if llm.llm_engine.kv_connector is None:
            raise ValueError("KVTierWidget needs an engine with a KV connector "
                             "(kv_transfer_config={'kv_connector': 'offloading', ...})")
        self.llm, self.requests, self.done = llm, list(requests), 0
        self.history: list[dict[str, dict[str, int]]] = []
        self.view = FigureView("labkit-kv-tiers-figure")
        self.step_button = widgets.Button(description="next request")
        self.all_button = widgets.Button(description="run all")
        self.status = widgets.HTML()
        self.step_button.on_click(lambda _: self.run(1))
        self.all_button.on_click(lambda _: self.run(len(self.requests)))
        super().__init__([widgets.HBox([self.step_button, self.all_button]), self.status,
                          self.view])
        self.add_class("labkit-kv-tiers")
        self.draw()

    def run(self, n: int) -> None:
        """Serve the next ``n`` requests (fewer if the list ends), redrawing after each."""
        for _ in range(n):
            if self.done == len(self.requests):
                break
            ids, params = self.requests[self.done]
            self.llm.generate(prompt_token_ids=[ids], sampling_params=params)
            self.done += 1
            self.history.append(tier_state(self.llm.llm_engine))
        self.draw()

    def draw(self) -> None:
        fig = go.Figure()
        now = self.history[-1] if self.history else tier_state(self.llm.llm_engine)
        tiers = list(now["blocks"])
        fig.add_bar(x=tiers, y=[now["blocks"][t] for t in tiers], name="blocks held",
                    marker_color=[TIER_COLORS.get(t, "#888") for t in tiers],
                    xaxis="x", yaxis="y")
        for t in now["hit_tokens"]:
            fig.add_scatter(x=list(range(1, len(self.history) + 1)),
                            y=[h["hit_tokens"].get(t, 0) for h in self.history],
                            name=f"{t} hits (tokens)", mode="lines+markers",
                            line_color=TIER_COLORS.get(t), xaxis="x2", yaxis="y2")
        fig.update_layout(
            title=f"after {self.done} of {len(self.requests)} requests", height=360, width=760,
            xaxis=dict(domain=[0, 0.35], title="tier"), yaxis=dict(title="blocks held"),
            xaxis2=dict(domain=[0.5, 1], title="requests served"),
            yaxis2=dict(anchor="x2", title="prompt tokens supplied (cumulative)"))
        self.figure = self.view.show(fig)
        self.status.value = (f"<div>{self.done} of {len(self.requests)} requests served; "
                             f"tiers now hold {now['blocks']}</div>")
