"""The roofline against hand-computed cases."""

import pytest

from labkit.sim.cost import (
    STEP_OVERHEAD_S,
    attention_pairs,
    max_kv_tokens,
    step_cost,
    step_time,
)

A100_BW = 2.039e12
A100_FLOPS = 312e12
L7_PARAMS = 6_738_415_616
L7_KV = 524_288


def test_decode_batch1_is_weight_read():
    # 13.48 GB of weights / 2.039 TB/s = 6.61 ms, plus the KV of one new token.
    t = step_time("llama-2-7b", "a100-80gb", 0, 1, 0)
    expected = (2 * L7_PARAMS + L7_KV) / A100_BW + STEP_OVERHEAD_S
    assert t == pytest.approx(expected, rel=1e-12)
    assert 6.6e-3 < t - STEP_OVERHEAD_S < 6.7e-3


def test_decode_memory_bound_batch_barely_matters():
    c1 = step_cost("llama-2-7b", "a100-80gb", 0, 1, 0)
    c32 = step_cost("llama-2-7b", "a100-80gb", 0, 32, 0)
    assert c1.bound == "memory" and c32.bound == "memory"
    # 32x the tokens for ~0.1% more time (only the 31 extra KV writes).
    assert c32.time_s / c1.time_s < 1.01


def test_decode_kv_reads_hand_computed():
    # 64 sequences, 1000 tokens of context each: weights + 64k tokens of KV read + 64 written.
    c = step_cost("llama-2-7b", "a100-80gb", 0, 64, 64_000)
    assert c.bytes == 2 * L7_PARAMS + L7_KV * 64_064
    assert c.memory_s == pytest.approx(c.bytes / A100_BW)


def test_prefill_compute_bound_hand_computed():
    # One 2048-token prompt: 2*P*T linear FLOPs + 4*L*H*D*pairs attention FLOPs.
    T = 2048
    pairs = T * (T + 1) // 2
    c = step_cost("llama-2-7b", "a100-80gb", T, 0, 0, attention_pairs=pairs)
    flops = 2 * L7_PARAMS * T + 4 * 32 * 32 * 128 * pairs
    assert c.flops == pytest.approx(flops, rel=1e-12)
    assert c.bound == "compute"
    assert c.time_s == pytest.approx(flops / A100_FLOPS + STEP_OVERHEAD_S, rel=1e-12)
    assert 0.09 < c.compute_s < 0.1  # ~92 ms at 100% of peak


def test_attention_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 1) == 11  # a decode token sees its 10 predecessors and itself
    assert attention_pairs(8, 3) == 9 + 10 + 11
    with pytest.raises(ValueError):
        attention_pairs(-1, 2)


def test_default_pairs_estimate_exact_for_decode_and_single_prefill():
    exact = step_cost("llama-3-8b", "h100", 0, 8, 800, attention_pairs=808)
    assert step_cost("llama-3-8b", "h100", 0, 8, 800).flops == exact.flops
    T = 100
    c = step_cost("llama-3-8b", "h100", T, 0, 0)
    assert c.flops >= step_cost("llama-3-8b", "h100", T, 0, 0,
                                attention_pairs=attention_pairs(0, T)).flops


def test_empty_step_and_bad_input():
    assert step_time("llama-2-7b", "a100", 0, 0, 0) == 0.0
    with pytest.raises(ValueError, match="num_decode_tokens"):
        step_time("llama-2-7b", "a100", 0, -1, 0)
    with pytest.raises(ValueError, match="valid names"):
        step_time("llama-9", "a100", 1, 0, 0)


def test_faster_gpu_is_faster():
    args = ("llama-2-7b",)
    a = step_time(*args, "a100", 0, 16, 16_000)
    h = step_time(*args, "h100", 0, 16, 16_000)
    assert h < a


def test_max_kv_tokens():
    free = 80 * 2**30 * 0.9 - 2 * L7_PARAMS
    assert max_kv_tokens("llama-2-7b", "a100-80gb") == int(free // L7_KV)
    with pytest.raises(ValueError, match="do not fit"):
        max_kv_tokens("llama-2-70b", "rtx-4090")
