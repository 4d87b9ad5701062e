"""FP8 (e4m3) KV cache in the paged engine (``kv_cache_dtype="fp8"``, vLLM's name; issue 33).

Reference: the model run one token at a time through the contiguous quantized cache with e4m3
codes (``Int8ContiguousKVCache(code_dtype=float8_e4m3fn)``: the same per-(token, head) scales
and rounding), so greedy engine output must equal it token for token, through chunked prefill,
prefix caching, swap preemption and forks. The quantizer itself is checked against e4m3's
rounding bound, and the cache's bytes against a hand computation.
"""

from __future__ import annotations

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.cache import kv_bytes_per_block
from labkit.kv.ops import FP8_KV_DTYPE, dequantize_kv_per_head, quantize_kv_per_head
from labkit.quant.kv_int8 import Int8ContiguousKVCache

pytestmark = pytest.mark.skipif(FP8_KV_DTYPE is None, reason="this torch has no float8_e4m3fn")
MAX_NEW = 10


@torch.inference_mode()
def fp8_reference(model, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    cache = Int8ContiguousKVCache(model, 1, len(prompt) + max_new, code_dtype=FP8_KV_DTYPE)
    ids = list(prompt)
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, -1]
    out = []
    for _ in range(max_new):
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        logits = model(torch.tensor([[tok]]), torch.tensor([[len(ids) - 1]]), cache)[0, -1]
    return out


def run_fp8(model, prompts, params=None, **kw):
    llm = LLM.from_model(model, None, kv_cache_dtype="fp8", **kw)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_no_leaks(llm.llm_engine)
    return outs, llm.llm_engine


def test_e4m3_codes_round_within_the_formats_bound():
    x = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :4] = torch.tensor([1e-3, -2e-2, 5.0, -7.5])  # small and large in one head
    q, scale = quantize_kv_per_head(x, FP8_KV_DTYPE)
    assert q.dtype == FP8_KV_DTYPE and scale.dtype == torch.float16
    # the largest |x| of each (token, head) maps to e4m3's largest finite value, 448
    top = (q.float().abs().amax(-1) * scale.float())
    torch.testing.assert_close(top, x.abs().amax(-1), rtol=2e-3, atol=0)
    back = dequantize_kv_per_head(q, scale)
    v = x / scale.float()[..., None]  # the value e4m3 rounded: 3 mantissa bits
    bound = scale.float()[..., None] * (v.abs() * 2 ** -4 + 2 ** -10)  # + subnormal half-step
    assert bool(((back - x).abs() <= bound * 1.01 + 1e-6).all())
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        quantize_kv_per_head(x, torch.float16)


@pytest.mark.parametrize("block_size,budget", [(4, 24), (16, 256)])
def test_fp8_engine_greedy_equals_fp8_reference(tiny_model, prompts, block_size, budget):
    outs, eng = run_fp8(tiny_model, prompts, block_size=block_size, max_num_seqs=4,
                        max_num_batched_tokens=budget)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == fp8_reference(tiny_model, p)
    kv = eng.executor.kv_cache
    assert kv.k_caches[0].dtype == FP8_KV_DTYPE and kv.k_scales[0].dtype == torch.float16
    assert eng.stats()["prefix_hit_tokens"] > 0  # shared prefixes reuse quantized blocks


def test_fp8_swap_and_fork_carry_codes_and_scales(tiny_model, prompts):
    outs, eng = run_fp8(tiny_model, prompts, block_size=4, num_blocks=16, preemption_mode="swap",
                        num_cpu_blocks=32, max_num_batched_tokens=32)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == fp8_reference(tiny_model, p)
    assert {x["mode"] for s in eng.trace.steps for x in s["preempted"]} == {"swap"}
    sp = SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs, _ = run_fp8(tiny_model, prompts[:2], sp, block_size=4)
    for p, o in zip(prompts[:2], outs):
        assert [c.token_ids for c in o.outputs] == [fp8_reference(tiny_model, p)] * 2


def test_fp8_bytes_and_backends(tiny_model):
    c = tiny_model.config
    # one byte per element, like INT8, plus a 2-byte scale per (token, head): half of bf16's
    want = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * (c.head_dim + 2)
    assert kv_bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim,
                              torch.bfloat16, "fp8") == want
    bf16 = kv_bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim,
                              torch.bfloat16)
    assert want < 0.6 * bf16  # both backends take it: tests/kernels/test_engine_triton_sinks_fp8.py


@pytest.mark.parametrize("code", [torch.int8, FP8_KV_DTYPE])
def test_an_all_zero_row_encodes_as_zeros_not_nan(code):
    """A (token, head) whose K or V is all zero (a zeroed channel, a pruned head) gets the scale
    floor 2**-24, fp16's smallest subnormal, and codes 0; a floor below fp16's range (the old
    1e-8) rounded the scale to 0 and encoded 0 / 0 = NaN, which attention then spread."""
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    x[1, 0] = 0.0
    q, scale = quantize_kv_per_head(x, code)
    assert float(scale[1, 0]) == 2.0 ** -24
    back = dequantize_kv_per_head(q, scale)
    assert not back.isnan().any()
    assert bool((back[1, 0] == 0).all())
    assert torch.allclose(back[0], x[0], rtol=0.07, atol=0.05)  # the others as before
