"""The simulator: same engine, virtual time from the roofline cost model."""

from __future__ import annotations

import pytest

from labkit.engine.trace import replay
from labkit.sim.cost import step_time
from labkit.sim.simulate import simulate
from labkit.sim.workloads import RequestSpec


def test_simulate_finishes_every_request_with_its_output_length():
    specs = [RequestSpec(prompt_len=20 + 7 * i, output_len=5 + i, arrival_time=0.01 * i)
             for i in range(30)]
    r = simulate("llama-2-7b", "a100-80gb", specs, block_size=16, max_num_seqs=8,
                 max_num_batched_tokens=64)
    by_req = {t["request_id"]: t for t in r.timings}
    for i, s in enumerate(specs):
        t = by_req[f"r{i}"]
        assert t["num_output_tokens"] == s.output_len and t["finish_reason"] == "length"
        assert t["arrival_time"] == pytest.approx(s.arrival_time)
    assert r.metrics["num_finished"] == 30
    steps = r.trace.steps
    assert r.trace.meta["executor"] == "sim"
    # virtual time: each step lasts exactly the cost model's step time
    st = steps[3]
    pre = sum(x["num_tokens"] for x in st["scheduled"] if x["phase"] == "prefill")
    dec = sum(x["num_tokens"] for x in st["scheduled"] if x["phase"] == "decode")
    ctx = sum(x["start_pos"] for x in st["scheduled"])
    pairs = sum(x["num_tokens"] * x["start_pos"] + x["num_tokens"] * (x["num_tokens"] + 1) // 2
                for x in st["scheduled"])
    assert st["duration"] == pytest.approx(step_time("llama-2-7b", "a100-80gb", pre, dec, ctx,
                                                     attention_pairs=pairs))
    assert all(a["time"] + a["duration"] <= b["time"] + 1e-12 for a, b in zip(steps, steps[1:]))
    assert all(s["num_batched_tokens"] <= 64 for s in steps)
    snap = replay(r.trace, -1)
    assert not snap.block_tables and not snap.ref_counts


def test_simulate_small_pool_preempts_and_prefix_group_hits():
    specs = [RequestSpec(64, 40, 0.0, prefix_group=0, prefix_len=48, seed=i) for i in range(20)]
    r = simulate("llama-2-7b", "a100-80gb", specs, kv_cache_bytes=40 * 16 * 524288)
    assert r.stats["num_preemptions"] > 0
    assert r.stats["prefix_hit_rate"] > 0.3  # 48 of 64 tokens shared; first wave all miss
    assert r.stats["num_used_blocks"] == 0


def test_continuous_beats_static_in_simulation():
    kw = dict(workload="uniform", num_requests=64, max_num_seqs=16, seed=1)
    cont = simulate(batching="continuous", **kw)
    stat = simulate(batching="static", **kw)
    assert cont.metrics["duration_s"] < stat.metrics["duration_s"]


def test_simulate_bad_config_is_a_named_error():
    from labkit.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="block_size"):
        simulate(num_requests=2, block_size=0)  # was: ZeroDivisionError
    with pytest.raises(EngineConfigError, match="kv_cache_bytes"):
        simulate(num_requests=2, kv_cache_bytes=10)


def test_swaps_and_copies_cost_time_in_the_simulator():
    """Swapped blocks cross PCIe and copy-on-write copies move HBM bytes: the simulator charges
    both (before this, a swap was free and always beat recomputation)."""
    from labkit.sim.presets import get_gpu, get_model_preset
    from labkit.sim.simulate import simulate

    m, g = get_model_preset("llama-2-7b"), get_gpu("a100-80gb")
    kw = dict(workload="fixed", num_requests=24, block_size=16, max_num_seqs=24,
              kv_cache_bytes=40 * 16 * m.kv_bytes_per_token, seed=0)
    swap = simulate("llama-2-7b", "a100-80gb", preemption_mode="swap", num_cpu_blocks=400, **kw)
    events = [e for s in swap.trace.to_dict()["steps"] for e in s["events"]]
    moved = sum(e["type"] in ("swap_out", "swap_in") for e in events)
    copies = sum(e["type"] == "cow" for e in events)
    assert moved > 0, "the tight pool must force swapping"
    block = 16 * m.kv_bytes_per_token
    expect = moved * block / g.host_bandwidth + copies * 2 * block / g.mem_bandwidth
    assert abs(swap.stats["block_ops_s"] - expect) <= 1e-9 * max(expect, 1.0)
    recompute = simulate("llama-2-7b", "a100-80gb", preemption_mode="recompute", **kw)
    assert recompute.stats["block_ops_s"] == 0.0
