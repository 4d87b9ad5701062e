"""Widgets on a trace from a real engine run (tiny random Llama, paged KV, prefix caching)."""

import pytest

from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.model.testing import tiny_model
from labkit.viz import LatencyWidget, MemoryWidget, PageTableWidget, ScheduleWidget
from labkit.viz import tracedata as td
from labkit.viz.latency import latency_samples
from labkit.viz.memory import memory_series

PREFIX = list(range(1, 13))  # three full 4-token blocks shared by r0 and r1


@pytest.fixture(scope="module")
def engine():
    model = tiny_model()
    eng = LLMEngine.from_model(model, None, block_size=4, num_blocks=24,
                               max_num_batched_tokens=16, max_num_seqs=4)
    greedy = dict(temperature=0.0, ignore_eos=True)
    eng.add_request("r0", PREFIX + [20, 21], SamplingParams(max_tokens=6, **greedy))
    eng.step()
    eng.step()
    eng.add_request("r1", PREFIX + [30, 31, 32], SamplingParams(max_tokens=5, **greedy))
    eng.add_request("r2", list(range(40, 70)), SamplingParams(max_tokens=4, **greedy))
    while eng.has_unfinished_requests():
        eng.step()
    return eng


def _step_where_shared(trace):
    for i in range(len(trace["steps"])):
        if any(r > 1 for r in td.snapshot(trace, i).ref_counts.values()):
            return i
    raise AssertionError("the run never shared a block")


def test_page_table_shows_the_shared_prefix(engine):
    trace = td.as_trace_dict(engine)
    step = _step_where_shared(trace)
    w = PageTableWidget(engine, step=step)
    grid = w.figure.data[0]
    shared = [p for p, t in enumerate(grid.text) if "×2" in t]
    assert len(shared) == 3  # the three full prefix blocks, nothing else
    for p in shared:
        # the block's tokens are a 4-token slice of the prompt we sent, at its logical index
        hover = grid.hovertext[p]
        logical = int(hover.split("r0 (logical ")[1].split(")")[0])
        assert f"tokens: {PREFIX[4 * logical:4 * logical + 4]}" in hover
    rows = list(w.figure.layout.yaxis2.ticktext)
    assert rows[:2] == ["r0", "r1"]
    for s in range(len(trace["steps"])):  # scrub the whole run forward and backward
        w.slider.value = s
    w.slider.value = 0
    assert "r0 prefill ×14" in w.summary.value


def test_schedule_and_memory_of_the_run(engine):
    trace = td.as_trace_dict(engine)
    w = ScheduleWidget(engine)
    fin = w.figure.data[3]
    assert sorted(fin.y) == ["r0", "r1", "r2"]
    assert w.states["r2"].count("chunked prefill") >= 1  # 30-token prompt, budget 16
    s = memory_series(trace)
    assert s["tokens"] == [r["kv"]["token_slots_used"] for r in trace["steps"]]
    assert s["paged"] == [4 * r["kv"]["used"] for r in trace["steps"]]
    # contiguous pre-allocation reserves prompt + max_tokens for each running request
    assert s["contiguous"][0] == 14 + 6
    MemoryWidget(engine)


def test_latency_from_trace_equals_engine_timings(engine):
    from_engine = latency_samples(engine.request_timings())
    from_trace = latency_samples(td.derive_timings(td.as_trace_dict(engine)))
    for key in ("TTFT", "TPOT", "ITL"):
        assert sorted(from_trace[key]) == pytest.approx(sorted(from_engine[key]))
    assert len(from_engine["ITL"]) == 5 + 4 + 3
    LatencyWidget(engine)


def test_page_table_reports_swapped_sequences():
    import labkit

    model = tiny_model()
    llm = labkit.LLM.from_model(model, None, block_size=4, num_blocks=12, num_cpu_blocks=16,
                                preemption_mode="swap", enable_prefix_caching=False)
    llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]],
                 sampling_params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    trace = td.as_trace_dict(llm.llm_engine)
    out = [i for i, r in enumerate(trace["steps"])
           if any(e["type"] == "swap_out" for e in r["events"])]
    assert out, "the pool was meant to be too small: no swap happened"
    w = PageTableWidget(trace, step=out[0])
    assert "swapped to CPU" in w.summary.value
    seq = next(e["seq_id"] for e in trace["steps"][out[0]]["events"] if e["type"] == "swap_out")
    assert seq not in list(w.figure.layout.yaxis2.ticktext)  # no GPU blocks while swapped
