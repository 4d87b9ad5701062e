"""The memory calculator against hand arithmetic and against real tensor bytes."""

import pytest

from labkit.quant import QuantizationError, estimate_memory, kv_cache_bytes, quantize_model
from labkit.quant.awq import awq_quantize_model
from labkit.quant.evaluate import model_bytes
from labkit.quant.model import gptq_quantize_model


def test_llama2_7b_reference_numbers():
    fp16 = estimate_memory("llama-2-7b", "fp16")
    assert fp16.weight_bytes == 6_738_415_616 * 2  # Llama-2-7B's parameter count x 2 bytes
    assert round(fp16.weight_bytes / 1e9, 1) == 13.5
    int4 = estimate_memory("llama-2-7b", "gptq", group_size=128)
    assert round(int4.weight_bytes / 1e9, 1) == 3.9
    # linears: 6.476e9 params at 0.5 B + fp16 scales and packed zeros per 128 + g_idx
    lin = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert int4.quantized_bytes == lin // 2 + lin // 128 * 2 + lin // 128 // 2 + \
        32 * (4 * 4096 + 2 * 4096 + 11008) * 4
    # KV: 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token
    assert kv_cache_bytes("llama-2-7b", 4096, batch_size=2) == 2 * 32 * 32 * 128 * 2 * 4096 * 2
    assert kv_cache_bytes("llama-2-7b", 100, kv_dtype="int8") == 2 * 32 * 32 * (128 + 2) * 100
    est = estimate_memory("llama-3-8b", "awq", context_len=8192, batch_size=4, kv_dtype="int8")
    assert est.total_bytes == est.weight_bytes + kv_cache_bytes("llama-3-8b", 8192, 4, "int8")


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4_rtn", "nf4", "fp8"])
def test_calculator_equals_tiny_model_tensor_bytes(tiny, fmt):
    model = tiny if fmt == "fp32" else quantize_model(tiny, fmt, group_size=32)
    est = estimate_memory(tiny.config, fmt, base_dtype="fp32", group_size=32)
    assert model_bytes(model) == est.weight_bytes


def test_calculator_equals_gptq_awq_and_double_quant_bytes(tiny, calib_tokens):
    g, _ = gptq_quantize_model(tiny, calib_tokens, group_size=32, progress=False)
    assert model_bytes(g) == estimate_memory(tiny.config, "gptq", base_dtype="fp32",
                                             group_size=32).weight_bytes
    a, _ = awq_quantize_model(tiny, calib_tokens, group_size=32, n_grid=4, progress=False)
    assert model_bytes(a) == estimate_memory(tiny.config, "awq", base_dtype="fp32",
                                             group_size=32).weight_bytes
    d = quantize_model(tiny, "nf4", double_quant=True)
    assert model_bytes(d) == estimate_memory(tiny.config, "nf4", base_dtype="fp32",
                                             double_quant=True).weight_bytes


def test_bad_names():
    with pytest.raises(ValueError, match="unknown model"):
        estimate_memory("gpt-5", "fp16")
    with pytest.raises(QuantizationError, match="unknown format"):
        estimate_memory("llama-2-7b", "int3")
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_cache_bytes("llama-2-7b", 10, kv_dtype="int4")
