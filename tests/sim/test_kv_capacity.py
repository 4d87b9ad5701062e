"""Concurrent 32k-token requests per H200 (labkit.sim.kv_capacity) against hand computations
from the models' config.json values."""

import pytest

from labkit.sim.kv_capacity import capacity_table, max_concurrent_requests, request_kv_bytes
from labkit.sim.presets import get_model_preset

GiB = 2**30
H200_BUDGET = 0.9 * 141 * GiB  # vLLM's gpu_memory_utilization of the 141 GiB


def test_gemma3_27b_by_hand():
    """62 layers, 16 KV heads of 128, bf16: 8,192 bytes per token and layer. 10 full layers
    hold all 32,768 tokens, 52 sliding layers their 1,024-token window."""
    per_layer_token = 2 * 16 * 128 * 2
    kv = 10 * 32768 * per_layer_token + 52 * 1024 * per_layer_token
    assert kv == 3_120_562_176
    assert request_kv_bytes("gemma-3-27b", 32768) == kv
    assert request_kv_bytes("gemma-3-27b", 32768, free_sliding=False) == \
        62 * 32768 * per_layer_token
    weights = 2 * 27_008_663_808  # the preset's parameter count, bf16
    assert get_model_preset("gemma-3-27b").weight_bytes == weights
    want = int((H200_BUDGET - weights) // kv)  # 82.24e9 / 3.12e9 = 26.35
    assert want == 26
    assert max_concurrent_requests("gemma-3-27b", "h200", 32768) == 26
    assert max_concurrent_requests("gemma-3-27b", "h200", 32768, free_sliding=False) == 4


def test_llama3_8b_by_hand():
    # 2 * 32 layers * 8 KV heads * 128 * 2 bytes = 128 KiB per token: 4 GiB per 32k request
    assert request_kv_bytes("llama-3-8b", 32768) == 4 * GiB
    assert max_concurrent_requests("llama-3-8b", "h200") == \
        int((H200_BUDGET - 2 * 8_030_261_248) // (4 * GiB)) == 27


def test_gpt_oss_window_caps_half_the_layers():
    per = 2 * 8 * 64 * 2  # 2,048 bytes per token and layer
    assert request_kv_bytes("gpt-oss-120b", 100) == 36 * 100 * per  # inside the window
    assert request_kv_bytes("gpt-oss-120b", 32768) == (18 * 32768 + 18 * 128) * per


def test_deepseek_v3_does_not_fit_one_h200():
    # 671B FP8 weights (625 GiB) exceed 141 GiB; over 8 the MLA latent is not split by TP
    assert max_concurrent_requests("deepseek-v3", "h200") == 0
    per_gpu = (H200_BUDGET - get_model_preset("deepseek-v3").weight_bytes / 8)
    assert max_concurrent_requests("deepseek-v3", "h200", tp=8) == \
        int(per_gpu // (61 * 576 * 2 * 32768))


def test_table_and_bad_input():
    rows = {r["model"]: r for r in capacity_table()}
    assert set(rows) == {"llama-3-8b", "qwen3-32b", "gemma-3-27b", "gpt-oss-120b", "deepseek-v3"}
    assert rows["qwen3-32b"]["kv_gib_per_request"] == 8.0  # 2*64*8*128*2*32768 bytes
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        max_concurrent_requests("llama-3-8b", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="context_len"):
        request_kv_bytes("llama-3-8b", 0)
