"""The KV-formats chart draws labkit's own numbers: every bar equals the simulator preset's
``kv_bytes`` (or the engine allocator's ``kv_bytes_per_block`` for FP8), and DeepSeek-V3's bars
equal the hand count (576 values per token and layer for MLA against MHA's 2 x 128 x 128)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from labkit.kv.cache import kv_bytes_per_block
from labkit.sim.presets import get_model_preset
from labkit.viz.kv_formats import LAYOUTS, kv_format_rows, kv_formats_figure


def test_deepseek_v3_by_hand():
    rows = {r["layout"]: r for r in kv_format_rows("deepseek-v3", context_len=32768)}
    L, bf16 = 61, 2  # 61 layers, a bf16 cache beside the FP8 weights
    assert rows["MHA"]["values_per_token_per_layer"] == 2 * 128 * 128
    assert rows["MHA"]["bytes_per_token"] == L * 2 * 128 * 128 * bf16 == 3_997_696
    assert rows["MLA"]["values_per_token_per_layer"] == 512 + 64 == 576
    assert rows["MLA"]["bytes_per_token"] == L * 576 * bf16 == 70_272
    assert rows["MLA"]["vs_mha"] == pytest.approx(576 / 32768, rel=1e-9)  # 57x fewer
    assert rows["GQA"]["bytes_per_token"] == L * 2 * 8 * 128 * bf16  # 8 KV heads by default
    assert rows["MQA"]["bytes_per_token"] == L * 2 * 1 * 128 * bf16
    # FP8: one byte per K and V element, one fp16 scale per token and KV head
    assert rows["FP8 (GQA)"]["bytes_per_token"] == L * 2 * 8 * (128 + 2)
    # every layer slides with window 4096: a 32k request holds 4096 tokens per layer
    assert rows["sliding window"]["bytes_per_token"] == L * 2 * 8 * 128 * bf16 * 4096 / 32768


def test_gpt_oss_sliding_by_hand():
    """gpt-oss-120b: 18 of 36 layers slide with window 128, 8 KV heads of 64, bf16."""
    r = {x["layout"]: x for x in kv_format_rows("gpt-oss-120b", context_len=4096)}
    per_layer_token = 2 * 8 * 64 * 2
    want = per_layer_token * (18 * 4096 + 18 * 128) / 4096
    assert r["sliding window"]["bytes_per_token"] == pytest.approx(want, rel=1e-12)
    assert r["GQA"]["bytes_per_token"] == 36 * per_layer_token


@pytest.mark.parametrize("model", ["deepseek-v3", "gpt-oss-120b", "gemma-3-27b", "qwen3-32b",
                                   "llama-3-8b"])
def test_bars_equal_the_library_numbers(model):
    """Each bar against the library function computed here on its own, not through the viz."""
    base = get_model_preset(model)
    n = 32768
    fig = kv_formats_figure(model, context_len=n)
    bar = fig.data[0]
    assert tuple(bar.x) == LAYOUTS
    got = dict(zip(bar.x, bar.y))
    gqa = base.num_kv_heads if base.num_kv_heads < base.num_heads else 8
    mha = replace(base, num_kv_heads=base.num_heads, sliding_window=0, num_sliding_layers=0,
                  **({"kv_lora_rank": 0} if hasattr(base, "kv_lora_rank") else {}))
    assert got["MHA"] * 1024 == mha.kv_bytes(n) / n
    assert got["GQA"] * 1024 == replace(mha, num_kv_heads=gqa).kv_bytes(n) / n
    assert got["MQA"] * 1024 == replace(mha, num_kv_heads=1).kv_bytes(n) / n
    fp8 = kv_bytes_per_block(base.num_layers, 1, gqa, base.head_dim, torch.bfloat16, "fp8")
    assert got["FP8 (GQA)"] * 1024 == fp8
    if base.num_sliding_layers:  # the preset's own sliding layers: the capacity table's bytes
        assert got["sliding window"] * 1024 == pytest.approx(
            replace(base, num_kv_heads=gqa).kv_bytes(n) / n, rel=1e-12)
    if getattr(base, "kv_lora_rank", 0):
        assert got["MLA"] * 1024 == base.kv_bytes_per_token  # the preset's own MLA
    assert fig.layout.meta["rows"][3]["layout"] == "MLA"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="divide"):
        kv_format_rows("llama-3-8b", gqa_kv_heads=5)
    with pytest.raises(ValueError, match="context_len"):
        kv_format_rows("llama-3-8b", context_len=0)
    with pytest.raises(Exception, match="gpt-9"):
        kv_format_rows("gpt-9")


def test_overrides_move_the_bars():
    a = {r["layout"]: r for r in kv_format_rows("llama-3-8b", window=1024, kv_lora_rank=256,
                                                 qk_rope_head_dim=32)}
    assert a["sliding window"]["bytes_per_token"] == 32 * 2 * 8 * 128 * 2 * 1024 / 32768
    assert a["MLA"]["values_per_token_per_layer"] == 288
    assert kv_formats_figure("llama-3-8b", log_y=True).layout.yaxis.type == "log"
