"""memory bench: the re-pricing helper by hand, the quick path at toy sizes."""

import pytest

from labkit.bench import memory


def test_same_schedule_contiguous_hand_computed():
    trace = {"meta": {"block_size": 4}, "steps": [
        {"duration": 1.0, "queues": {"running": 2}, "kv": {"token_slots_used": 10}},
        {"duration": 3.0, "queues": {"running": 1}, "kv": {"token_slots_used": 6}},
        {"duration": 5.0, "queues": {"running": 0}, "kv": {"token_slots_used": 0}},
    ]}
    # (1*10 + 3*6) / (1*2*16 + 3*1*16)
    assert memory.same_schedule_contiguous(trace, 16) == pytest.approx(28 / 80)


def test_quick_run_toy_sizes(tiny_ckpt):
    sizes = {"sim_requests": 40, "real_requests": 3, "real_max_prompt": 24,
             "real_max_output": 24}
    out = memory.run(tiny_ckpt, quick=True, sizes=sizes)
    p, c = out["paged_utilization"], out["contiguous_utilization"]
    assert 0 < c < p <= 1
    for setting in ("sim", "real"):
        rows = {r["allocator"]: r for r in out[setting]["rows"]}
        assert rows["paged"]["block_size"] == 16
        assert rows["contiguous"]["block_size"] == out[setting]["max_len"]
        assert 0 < rows["contiguous"]["utilization"] < rows["paged"]["utilization"] <= 1
        assert 0 < out[setting]["contiguous_same_schedule"] <= 1
