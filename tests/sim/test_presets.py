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
