"""INT8 KV cache: quantizer error bounds, and the model through an INT8 cache vs fp32."""

import torch

from labkit.model.generate import ContiguousKVCache, generate
from labkit.model.llama import causal_attention
from labkit.quant import Int8ContiguousKVCache, quantize_kv_per_block, quantize_kv_per_head
from labkit.quant.kv_int8 import dequantize_kv_per_block, dequantize_kv_per_head


def test_per_head_and_per_block_error_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 10, 4, 16, generator=g) * torch.tensor([1.0, 10, 0.1, 3])[:, None]
    q, s = quantize_kv_per_head(x)
    assert q.dtype == torch.int8 and s.shape == (2, 10, 4)
    assert ((dequantize_kv_per_head(q, s) - x).abs() <= s.float()[..., None] / 2 + 1e-6).all()
    cache = x.reshape(5, 4, 4, 16)  # 5 blocks of 4 tokens
    qb, sb = quantize_kv_per_block(cache)
    assert sb.shape == (5, 4)
    err = (dequantize_kv_per_block(qb, sb) - cache).abs()
    assert (err <= sb.float()[:, None, :, None] / 2 + 1e-6).all()
    # per-(token, head) scales are never coarser than the block's
    assert s.reshape(5, 4, 4).float().le(sb.float()[:, None, :] + 1e-6).all()


class _QuantDequantCache(ContiguousKVCache):
    """Independent reference: fp cache that stores K/V rounded through int8 by plain torch."""

    def attend(self, layer_idx, q, k, v, positions):
        def qd(t):
            s = (t.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).half().float()
            return (t / s).round().clamp(-127, 127) * s

        return super().attend(layer_idx, q, qd(k), qd(v), positions)


def test_int8_cache_equals_quant_dequant_reference_and_is_close_to_fp(tiny):
    t = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = tiny(t)
    c = Int8ContiguousKVCache(tiny, 2, 64)
    out = tiny(t, kv_cache=c)
    torch.testing.assert_close(out, tiny(t, kv_cache=_QuantDequantCache(tiny, 2, 64)),
                               atol=1e-5, rtol=1e-5)
    assert 0 < (out - ref).abs().max() < 0.02
    # incremental (prefill 30 then 10 tokens) equals one shot: per-token scales never change
    c2 = Int8ContiguousKVCache(tiny, 2, 64)
    a = tiny(t[:, :30], kv_cache=c2)
    b = tiny(t[:, 30:], positions=torch.arange(30, 40).expand(2, 10), kv_cache=c2)
    torch.testing.assert_close(torch.cat([a, b], 1), out, atol=1e-5, rtol=1e-5)
    # bytes: int8 + one fp16 scale per (token, head) vs fp32
    fp_bytes = sum(x.numel() * 4 for x in ContiguousKVCache(tiny, 2, 64).k) * 2
    assert c.nbytes() == fp_bytes // 4 + 2 * 2 * 2 * 64 * 2 * 2


def test_int8_cache_attention_matches_plain_attention_on_dequantized_kv():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 7, h, 8, generator=g) for h in (4, 2, 2))

    class M:  # just enough of a model for the cache constructor
        class config:
            num_key_value_heads, head_dim, num_hidden_layers = 2, 8, 1
            sliding_window = None

        device, dtype = torch.device("cpu"), torch.float32

    c = Int8ContiguousKVCache(M, 1, 16)
    out = c.attend(0, q, k, v, torch.arange(7)[None])
    kd = dequantize_kv_per_head(*quantize_kv_per_head(k))
    vd = dequantize_kv_per_head(*quantize_kv_per_head(v))
    torch.testing.assert_close(out, causal_attention(q, kd, vd))


def test_greedy_decode_through_int8_cache_mostly_agrees_with_reference(tiny):
    """Decode token by token through the INT8 cache (the engine's access pattern)."""
    prompt = [3, 17, 42, 9, 1]
    ref = generate(tiny, prompt, 12, ignore_eos=True)
    cache = Int8ContiguousKVCache(tiny, 1, 32)
    logits = tiny(torch.tensor([prompt]), kv_cache=cache)
    out = []
    for pos in range(len(prompt), len(prompt) + 12):
        out.append(int(logits[0, -1].argmax()))
        logits = tiny(torch.tensor([[out[-1]]]), positions=torch.tensor([[pos]]), kv_cache=cache)
    assert sum(a == b for a, b in zip(ref, out)) >= 10
