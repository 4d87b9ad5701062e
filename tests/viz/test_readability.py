"""Issue 19's chart fixes: no flattened bars, comparable p99s, sentences on hover, figures that
fit their box, widgets that open at the informative step."""

import pytest

from labkit.sim.simulate import simulate
from labkit.viz import LatencyWidget, MemoryWidget, PageTableWidget, ScheduleWidget
from labkit.viz import tracedata as td


@pytest.fixture(scope="module")
def runs():
    kw = dict(model="llama-2-7b", gpu="a100-80gb", workload="chat", num_requests=24, seed=0)
    return {b: simulate(max_num_batched_tokens=b, **kw) for b in (512, 8192)}


def test_schedule_states_an_off_scale_budget_instead_of_flattening_the_bars(runs):
    w = ScheduleWidget(runs[8192])
    steps = runs[8192].trace.to_dict()["steps"]
    busiest = max(r["num_batched_tokens"] for r in steps)
    assert busiest * 2 < 8192
    top = w.figure.layout.yaxis.range[1]
    assert top == pytest.approx(busiest * 1.15), "the bars must fill their axis"
    budget = next(t for t in w.figure.data if t.name == "token budget")
    assert budget.visible == "legendonly"
    assert any("token budget 8,192" in a.text for a in w.figure.layout.annotations)


def test_latency_widget_compares_runs_p99_side_by_side(runs):
    w = LatencyWidget({"budget 512": runs[512], "budget 8192": runs[8192]})
    p99 = {a.text for a in w.figure.layout.annotations if a.text.startswith("p99")}
    for label, r in (("budget 512", runs[512]), ("budget 8192", runs[8192])):
        assert f"p99 {label}: {r.metrics['itl']['p99'] * 1e3:.0f} ms" in p99
    assert w.table.value.count("<tr>") == 1 + 2 * 3


def test_latency_labels_of_one_run_sit_at_different_heights(runs):
    w = LatencyWidget(runs[512])
    marks = [a for a in w.figure.layout.annotations if a.text in ("p50", "p90", "p99")]
    assert len(marks) == 9 and len({a.yshift for a in marks}) == 3


def test_memory_hover_is_a_sentence(runs):
    w = MemoryWidget(runs[512])
    for t in w.figure.data:
        assert t.hovertemplate.startswith("step %{x}: ") and t.hovertemplate.count(".") >= 1
    assert "contiguous pre-allocation would reserve" in w.figure.data[0].hovertemplate


def test_page_table_fits_its_box_and_opens_at_peak_use(runs):
    trace = runs[512].trace.to_dict()
    w = PageTableWidget(trace, max_blocks=512)
    assert w.figure.layout.width <= 880
    step = w.slider.value
    assert step == td.peak_step(trace) and step < w.slider.max
    assert trace["steps"][step]["kv"]["used"] == max(r["kv"]["used"] for r in trace["steps"])
