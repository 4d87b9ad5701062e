"""Presets against independently published numbers (model cards, datasheets)."""

import pytest

from labkit.sim.presets import GPUS, MODELS, get_gpu, get_model_preset

# Parameter counts published on the models' Hugging Face pages / safetensors metadata.
PUBLISHED_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "llama-2-70b": 68_976_648_192,
    "llama-3.2-1b": 1_235_814_400,
    "tinyllama-1.1b": 1_100_048_384,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED_PARAMS.items()))
def test_num_params_match_published(name, count):
    assert get_model_preset(name).num_params == count


def test_kv_bytes_per_token_hand_computed():
    # Llama-2-7B: 2 (K,V) * 32 layers * 32 heads * 128 dim * 2 bytes = 512 KiB per token.
    assert get_model_preset("llama-2-7b").kv_bytes_per_token == 524_288
    # Llama-3-8B uses GQA with 8 KV heads: 4x less.
    assert get_model_preset("llama-3-8b").kv_bytes_per_token == 131_072
    # Llama-2-70B: 2 * 80 * 8 * 128 * 2.
    assert get_model_preset("llama-2-70b").kv_bytes_per_token == 327_680


def test_weight_bytes_bf16():
    m = get_model_preset("llama-2-7b")
    assert m.weight_bytes == 2 * 6_738_415_616
    assert 13.4e9 < m.weight_bytes < 13.6e9


def test_gpu_datasheet_values():
    a100 = get_gpu("a100-80gb")
    assert a100.peak_flops == pytest.approx(312e12)
    assert a100.mem_bandwidth == pytest.approx(2.039e12)
    assert a100.mem_bytes == 80 * 2**30
    assert get_gpu("H100").mem_bandwidth == pytest.approx(3.35e12)
    assert get_gpu("h200").mem_bytes > get_gpu("h100").mem_bytes
    # Decode is memory-bound on every preset: ridge point far above 1 FLOP/byte.
    assert all(g.ridge_point > 100 for g in GPUS.values())


def test_aliases_and_case():
    assert get_gpu("A100") is GPUS["a100-80gb"]
    assert get_gpu("RTX 4090") is GPUS["rtx-4090"]
    assert get_model_preset("Llama-2-7B") is MODELS["llama-2-7b"]


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="a100-80gb"):
        get_gpu("tpu-v5")
    with pytest.raises(ValueError, match="llama-2-7b"):
        get_model_preset("gpt-5")


# Mixtures of experts: totals and active counts against the published ones. Mixtral and Qwen3
# publish exact totals (their safetensors metadata), so those are equal; DeepSeek-V3's report
# says "671B total, 37B activated", without the multi-token-prediction module (one more MoE layer,
# 14B: the 685B on its model page), so within 0.1%. Active counts are published to two or three
# significant figures and sometimes truncated (Qwen3: 3.353B here, "3.3B" on its card;
# DeepSeek-V3: 37.55B counting the 0.93B embedding table, "37B"), so within 2%.
@pytest.mark.parametrize("name,total,total_rel,active", [
    ("mixtral-8x7b", 46_702_792_704, 0, 12.9e9),
    ("qwen3-30b-a3b", 30_532_122_624, 0, 3.3e9),
    ("deepseek-v3", 671e9, 1e-3, 37e9),
])
def test_moe_params_match_published(name, total, total_rel, active):
    m = get_model_preset(name)
    assert m.num_params == pytest.approx(total, rel=total_rel, abs=0)
    assert m.active_params == pytest.approx(active, rel=0.02)
    assert m.active_params < m.num_params


def test_qwen3_moe_non_embedding_count():
    # Qwen3-30B-A3B's card: 29.9B non-embedding (untied embedding and LM head left out)
    m = get_model_preset("qwen3-30b-a3b")
    assert m.num_params - 2 * m.vocab_size * m.hidden_size == pytest.approx(29.9e9, abs=0.05e9)


def test_moe_geometry_by_hand():
    ds = get_model_preset("DeepSeek-V3")
    assert (ds.moe_layers, ds.num_experts, ds.num_experts_per_tok) == (58, 256, 8)
    assert ds.expert_params == 3 * 7168 * 2048
    # MLA caches one latent (512) and one shared rope key (64) per token and layer, bf16
    assert ds.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    # ... which TP cannot split: every rank keeps it (GQA splits by KV head)
    assert ds.kv_bytes_per_token_per_gpu(8) == ds.kv_bytes_per_token
    mix = get_model_preset("mixtral")
    assert mix.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert mix.kv_bytes_per_token_per_gpu(8) == mix.kv_bytes_per_token // 8
    # FP8 weights: about 671 GB, 625 GiB
    assert ds.weight_bytes == ds.num_params and 624 < ds.weight_bytes / 2**30 < 626


def test_moe_step_reads_the_touched_experts():
    """Batch 1 reads exactly the active weights (k of E experts per layer); a few thousand
    tokens touch every expert; the FLOPs count the active parameters only."""
    from labkit.sim.cost import step_cost

    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"):
        m = get_model_preset(name)
        assert m.weight_bytes_read(1) == pytest.approx(m.active_params * m.dtype_bytes,
                                                       rel=1e-12)
        assert m.weight_bytes_read(4096) == pytest.approx(m.weight_bytes, rel=1e-6)
        c = step_cost(m, "h200", 0, 1, 0)
        attn = 4.0 * m.num_layers * m.num_heads * m.head_dim * 1
        assert c.flops == pytest.approx(2.0 * m.active_params + attn, rel=1e-12)
    dense = get_model_preset("llama-2-7b")
    assert dense.active_params == dense.num_params
    assert dense.weight_bytes_read(1) == dense.weight_bytes
