"""gpt-oss's attention sinks in the Triton decode and prefill kernels (interpreter on CPU).

A sink is one logit per query head that joins the softmax's denominator and carries no value
(``labkit.model.sinks``). Checked against the torch backend (``attention_with_sinks``) and
against a float64 reference written here from the definition, position by position, over
float, INT8 and FP8 caches, with and without a sliding window, decode split and unsplit; plus a
one-key case by hand and bad input.
"""

import math

import pytest
import torch
from labkit.kernels.backend import TritonBackend
from labkit.kernels.paged_attention import paged_attention_decode
from labkit.kernels.paged_prefill import paged_prefill_attention
from paged_fixtures import make_paged

from labkit.kv.attention import TorchBackend
from labkit.kv.ops import dequantize_kv_per_head, quantize_kv_per_head

KINDS = {"float": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def sink_reference(q, k_cache, v_cache, block_tables, ctx, q_pos, scale, sinks, window):
    """float64, by the definition: for query row i of sequence ``seq[i]`` at position
    ``q_pos[i]``, p_j = exp(s_j) / (exp(sink_h) + sum_visible exp(s_i)), out = sum_j p_j v_j;
    key j lives at block_tables[b, j // bs], row j % bs."""
    rows, hq, _ = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(rows, hq, q.shape[2], dtype=torch.float64)
    for i, (b, pos) in enumerate(q_pos):
        lo = 0 if window is None else max(0, pos - window + 1)
        keys = range(lo, pos + 1)
        for h in range(hq):
            kh = h // (hq // hkv)
            k = torch.stack([k_cache[block_tables[b, j // bs], j % bs, kh] for j in keys])
            v = torch.stack([v_cache[block_tables[b, j // bs], j % bs, kh] for j in keys])
            s = (k.double() @ q[i, h].double()) * scale
            m = max(float(s.max()), float(sinks[h]))
            e = torch.exp(s - m)
            out[i, h] = (e @ v.double()) / (e.sum() + math.exp(float(sinks[h]) - m))
    return out


def _caches(kind, lens, hkv, dim, bs, seed):
    kc, vc, bt, cl, g = make_paged(lens, hkv, dim, bs, torch.float32, seed)
    if KINDS[kind] is None:
        return kc, vc, {}, kc, vc, bt, cl, g
    kq, ks = quantize_kv_per_head(kc, KINDS[kind])
    vq, vs = quantize_kv_per_head(vc, KINDS[kind])
    kd, vd = dequantize_kv_per_head(kq, ks), dequantize_kv_per_head(vq, vs)
    return kq, vq, {"k_scale": ks, "v_scale": vs}, kd, vd, bt, cl, g


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("window", [None, 5])
def test_decode_with_sinks(kind, window):
    hq, hkv, dim, bs = 4, 2, 16, 4
    lens = [1, 6, 19]
    kc, vc, kw, kd, vd, bt, cl, g = _caches(kind, lens, hkv, dim, bs, seed=len(kind))
    q = torch.randn(len(lens), hq, dim, generator=g)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])  # small to dominant against O(1) scores
    scale = dim ** -0.5
    want = TorchBackend().decode(q, kc, vc, bt, cl, scale, sliding_window=window, sinks=sinks,
                                 **kw)
    ref = sink_reference(q, kd, vd, bt, cl, [(b, n - 1) for b, n in enumerate(lens)], scale,
                         sinks, window)
    for splits in (1, 3):  # 3: the sink joins in the merge, once
        got = paged_attention_decode(q, kc, vc, bt, cl, scale, num_splits=splits, block_n=16,
                                     sliding_window=window, sinks=sinks, **kw)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)
    plain = paged_attention_decode(q, kc, vc, bt, cl, scale, sliding_window=window, **kw)
    assert (plain - want).abs().max() > 1e-2  # the sinks changed the answer


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_sinks(kind, window):
    hq, hkv, dim, bs = 4, 1, 16, 4
    spec = [(6, 6), (7, 13), (1, 9)]  # (q_len, ctx): a prompt, a chunk after a prefix, 1 token
    lens = [c for _, c in spec]
    kc, vc, kw, kd, vd, bt, cl, g = _caches(kind, lens, hkv, dim, bs, seed=3 + len(kind))
    qsl = torch.tensor([0, 6, 13, 14], dtype=torch.int32)
    q = torch.randn(14, hq, dim, generator=g)
    sinks = torch.tensor([1.5, -0.5, 0.0, 3.0], dtype=torch.bfloat16)  # the model's dtype
    scale = dim ** -0.5
    args = (q, kc, vc, bt, qsl, cl, scale)
    want = TorchBackend().prefill(*args, sliding_window=window, sinks=sinks, **kw)
    pos = [(b, c - n + j) for b, (n, c) in enumerate(spec) for j in range(n)]
    ref = sink_reference(q, kd, vd, bt, cl, pos, scale, sinks.float(), window)
    got = paged_prefill_attention(*args, block_m=16, block_n=16, sliding_window=window,
                                  sinks=sinks, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)
    tb = TritonBackend().prefill(*args, sliding_window=window, sinks=sinks, **kw)
    torch.testing.assert_close(tb, got, atol=0, rtol=0)  # the backend passes them through


def test_one_key_by_hand():
    """One key: out = v * e^a / (e^a + e^sink), a = q.k * scale. q.k = 2, scale 0.5: a = 1."""
    k_cache = torch.zeros(2, 4, 1, 16)
    v_cache = torch.zeros(2, 4, 1, 16)
    k_cache[1, 0, 0, :2] = 1.0
    v_cache[1, 0, 0] = torch.arange(16.0)
    q = torch.zeros(1, 2, 16)
    q[0, :, :2] = 1.0
    bt, cl = torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    sinks = torch.tensor([0.0, 3.0])
    got = paged_attention_decode(q, k_cache, v_cache, bt, cl, 0.5, sinks=sinks)
    w = [math.e / (math.e + math.exp(s)) for s in (0.0, 3.0)]  # 0.731, 0.119
    want = torch.stack([torch.arange(16.0) * wi for wi in w])[None]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    pre = paged_prefill_attention(q, k_cache, v_cache, bt, torch.tensor([0, 1]), cl, 0.5,
                                  sinks=sinks)  # q as one new token [N = 1, Hq, D]
    torch.testing.assert_close(pre, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3), r"sinks must be \[num_q_heads\] = \[2\]"),
    (torch.zeros(1, 2), r"sinks must be \[num_q_heads\]"),
    (torch.zeros(2, dtype=torch.int32), "sinks must be fp16, bf16 or fp32"),
])
def test_bad_sinks_are_a_value_error(bad, match):
    kc = torch.zeros(2, 4, 1, 16)
    q = torch.zeros(1, 2, 16)
    bt, cl = torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        paged_attention_decode(q, kc, kc, bt, cl, 0.5, sinks=bad)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, kc, kc, bt, torch.tensor([0, 1]), cl, 0.5, sinks=bad)
