"""Widgets on the synthetic trace, replayed by the engine's own fold (labkit.engine.trace)."""

import pytest

from labkit.viz import tracedata as td
from labkit.viz.latency import LatencyWidget, latency_samples
from labkit.viz.page_table import PageTableWidget
from labkit.viz.schedule import ScheduleWidget
from labkit.viz.spec import SpecWidget, spec_series

from .synthetic import build_spec_trace, reference_replay


@pytest.fixture
def fold():
    """The widgets use the engine's replay; it must agree with the fixture's own fold."""
    from labkit.engine.trace import replay

    return replay


@pytest.mark.parametrize("step", range(6))
def test_engine_replay_agrees_with_reference_fold(trace, step):
    from labkit.engine.trace import replay

    got, want = replay(trace, step), reference_replay(trace, step)
    assert got.block_tables == want.block_tables
    assert got.ref_counts == want.ref_counts
    assert got.cached == want.cached and got.free == want.free


def _tables(w):
    t = w.figure.data[1]
    rows = list(w.figure.layout.yaxis2.ticktext)
    out = {}
    for x, y, p in zip(t.x, t.y, t.text):
        out.setdefault(rows[y], []).append((x, int(p)))
    return out


def test_page_table_shared_prefix_block(trace, fold):
    w = PageTableWidget(trace, step=1)
    assert _tables(w) == {"A": [(0, 0), (1, 1)], "B": [(0, 0), (1, 2)]}
    grid = w.figure.data[0]
    assert grid.text[0] == "0×2" and grid.marker.line.width[0] == 3
    assert grid.marker.line.width[1] < 3
    assert "tokens: [1, 2, 3, 4]" in grid.hovertext[0]
    assert "owners: A (logical 0), B (logical 0)" in grid.hovertext[0]
    colors = td.request_color(trace)
    assert grid.marker.color[1] == colors["A"] and grid.marker.color[2] == colors["B"]
    assert grid.marker.color[9] == td.FREE_COLOR


def test_page_table_slider_replays_backward_and_forward(trace, fold):
    w = PageTableWidget(trace)
    # opens where the most blocks are in use (the last step has freed almost everything)
    used = [sum(1 for r in reference_replay(trace, s).ref_counts.values() if r > 0)
            for s in range(6)]
    assert w.slider.value == used.index(max(used)) and w.slider.max == 5
    assert used[w.slider.value] > used[5]
    w.slider.value = 4  # everything freed; full prompt blocks stay prefix-cached
    grid = w.figure.data[0]
    cached = {p for p, c in enumerate(grid.marker.color) if c == td.CACHED_COLOR}
    assert cached == {0, 3, 4}
    assert len(w.figure.data[1].x) == 0
    assert "prefix-cached" in grid.hovertext[3] and "[30, 31, 32, 33]" in grid.hovertext[3]
    assert "preempted D (recompute)" in w.summary.value
    w.prev_button.click()
    assert w.slider.value == 3
    assert _tables(w) == {"C": [(0, 3), (1, 4), (2, 5)], "D": [(0, 0), (1, 6)]}
    w.next_button.click()
    w.next_button.click()
    w.next_button.click()  # clamps at the last step
    assert w.slider.value == 5
    assert _tables(w) == {"D": [(0, 0), (1, 3)]}  # block 3 was evicted and reallocated


def test_page_table_colour_modes(trace, fold):
    w = PageTableWidget(trace, step=1, color_by="state")
    grid = w.figure.data[0]
    assert grid.marker.color[0] == "#7b3294" and grid.marker.color[1] == "#4c78a8"
    w.color_by.value = "ref count"
    assert w.figure.data[0].marker.color[0] != w.figure.data[0].marker.color[1]
    with pytest.raises(ValueError, match="color_by"):
        PageTableWidget(trace, color_by="rainbow")


def test_page_table_decodes_tokens_with_a_tokenizer(trace, fold):
    class Tok:
        def decode(self, ids):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    w = PageTableWidget(trace, step=0, tokenizer=Tok())
    assert "text: 'bcde'" in w.figure.data[0].hovertext[0]


def test_schedule_gantt_codes_and_budget(trace):
    w = ScheduleWidget(trace)
    bars, budget, heat, fin = w.figure.data[:4]
    assert list(bars.y) == [6, 3, 7, 5, 1, 2]
    assert list(budget.y) == [8] * 6
    code = {s: i for i, s in enumerate(td.STATES)}
    assert list(heat.z[3]) == [None, None, None, code["prefill"], code["preempted"],
                               code["prefill"]]
    assert list(zip(fin.x, fin.y)) == [(2, "A"), (2, "B"), (4, "C")]
    assert "1 preemptions" in w.summary.value and "2 chunked-prefill" in w.summary.value
    w.step = 3
    assert w.step == 3


def test_latency_samples_by_hand(trace):
    s = latency_samples(td.derive_timings(trace))
    assert s["TTFT"] == pytest.approx([0.01, 0.02, 0.02, 0.01])
    assert s["TPOT"] == pytest.approx([0.01, 0.01, 0.01, 0.02])
    assert sorted(s["ITL"]) == pytest.approx([0.01, 0.01, 0.01, 0.01, 0.02])
    w = LatencyWidget(trace)
    assert "<td>TTFT</td><td>4</td><td>15.00</td><td>15.00</td>" in w.table.value


def test_spec_series_and_widget():
    trace = build_spec_trace(gamma=4)
    s = spec_series(trace)
    assert s["accepted"] == [4, 1, 0, 3, 2, 4]
    assert s["rejected"] == [0, 3, 4, 1, 2, 0]
    assert s["rate"][-1] == pytest.approx(14 / 24)
    w = SpecWidget(trace)
    w.slider.value = 1
    assert w.tokens.value.count("line-through") == 3
    trace["steps"][0]["spec"][0]["accepted"] = 9
    with pytest.raises(ValueError, match="accepted 9"):
        spec_series(trace)


def test_spec_widget_needs_spec_steps(trace):
    with pytest.raises(ValueError, match="speculative"):
        SpecWidget(trace)


def _edges(nodes):
    by_id = {n["id"]: n for n in nodes}
    return {(by_id[n["parent"]]["physical"] if n["parent"] else None, n["physical"], n["state"])
            for n in nodes}


def test_prefix_tree_by_hand(trace):
    from labkit.viz.prefix_tree import PrefixTreeWidget, prefix_tree

    # step 1: A and B share block 0, then branch into their own second blocks
    assert _edges(prefix_tree(trace, 1)) == {(None, 0, "in use"), (0, 1, "in use"),
                                             (0, 2, "in use")}
    # step 2: A and B finished; their full prompt block 0 stays cached, C's two blocks in use
    assert _edges(prefix_tree(trace, 2)) == {(None, 0, "cached"), (None, 3, "in use"),
                                             (3, 4, "in use")}
    # step 4: everyone freed: cached blocks 0 and C's chain 3 -> 4
    assert _edges(prefix_tree(trace, 4)) == {(None, 0, "cached"), (None, 3, "cached"),
                                             (3, 4, "cached")}
    # step 5: block 3 was evicted and reused by D under block 0; C's block 4 lost its parent
    assert _edges(prefix_tree(trace, 5)) == {(None, 0, "in use"), (0, 3, "in use"),
                                             (None, 4, "cached")}
    w = PrefixTreeWidget(trace, step=1)
    icicle = w.figure.data[0]
    assert list(icicle.parents).count("root") == 1 and len(icicle.ids) == 4
    w.slider.value = 4
    assert "3 live blocks (3 cached" in w.summary.value


def test_widgets_colour_requests_by_group(trace, fold):
    """LoRA: requests of one adapter share a colour in the page table and the Gantt labels."""
    groups = {"A": "sql", "B": "base", "C": "sql", "D": "code"}
    w = PageTableWidget(trace, step=1, groups=groups)
    pal = td.REQUEST_PALETTE
    assert w.colors == {"A": pal[0], "B": pal[1], "C": pal[0], "D": pal[2]}
    grid, owner = w.figure.data[0], w.block_state(1)["owners"]
    for p, holders in owner.items():
        assert grid.marker.color[p] == w.colors[td.seq_request(holders[0][0])]
    legend = w.legend.value
    assert "sql" in legend and "code" in legend and " A</span>" not in legend
    s = ScheduleWidget(trace, groups=groups)
    ticks = dict(zip(s.figure.layout.yaxis2.tickvals, s.figure.layout.yaxis2.ticktext))
    assert ticks["C"] == f"<span style='color:{pal[0]}'>C · sql</span>"
