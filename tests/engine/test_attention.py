"""Paged attention (torch backend) against plain causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from labkit.kv.attention import get_attention_backend
from labkit.model.llama import causal_attention


@pytest.mark.parametrize("block_size", [1, 4, 5])
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_and_decode_match_contiguous(block_size, window):
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, nb = 4, 2, 8, 64
    ctx_lens, q_lens = [9, 13, 1, 7], [3, 1, 1, 7]
    be = get_attention_backend("torch")
    kc = torch.zeros(nb, block_size, Hkv, D)
    vc = torch.zeros(nb, block_size, Hkv, D)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, qs, refs = [], [], []
    for S, T in zip(ctx_lens, q_lens):
        k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
        q = torch.randn(T, Hq, D, generator=g)
        n = -(-S // block_size)
        table = [perm.pop() for _ in range(n)]
        pos = torch.arange(S)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        be.reshape_and_cache(k, v, kc, vc, slots)
        tables.append(table)
        qs.append(q)
        refs.append(causal_attention(q[None], k[None], v[None], window)[0])
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    kw = {"sliding_window": window} if window else {}
    out = be.prefill(torch.cat(qs), kc, vc, bt, qsl, ctx, D ** -0.5, **kw)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    last = torch.stack([q[-1] for q in qs])
    dec = be.decode(last, kc, vc, bt, ctx, D ** -0.5, **kw)
    torch.testing.assert_close(dec, torch.stack([r[-1] for r in refs]), atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_skips_padding_slots():
    be = get_attention_backend("torch")
    kc, vc = torch.zeros(2, 2, 1, 1), torch.zeros(2, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    be.reshape_and_cache(k, -k, kc, vc, torch.tensor([3, -1, 0]))
    assert kc.flatten().tolist() == [3.0, 0.0, 0.0, 1.0]
    assert vc.flatten().tolist() == [-3.0, 0.0, 0.0, -1.0]


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cuda-magic")


def _paged_case(g, block_size, ctx_lens, q_lens, Hq=4, Hkv=2, D=8, nb=64):
    """Random contiguous K/V per sequence, scattered into shuffled blocks; host-side lists."""
    perm = torch.randperm(nb, generator=g).tolist()
    seqs, tables, slots = [], [], []
    for S, T in zip(ctx_lens, q_lens):
        k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
        table = [perm.pop() for _ in range(-(-S // block_size))]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(S)]
        seqs.append((k, v, torch.randn(T, Hq, D, generator=g)))
        tables.append(table)
    return seqs, tables, slots


@pytest.mark.parametrize("q_lens", [[3, 1, 1, 7], [4, 4, 4, 4], [1, 1, 1, 1]])
@pytest.mark.parametrize("window", [None, 6])
def test_step_metadata_reused_across_layers(q_lens, window):
    """One AttentionMetadata serves every layer: two 'layers' with different K/V read through
    the same metadata (plans built by the first call) match plain attention on each."""
    from labkit.kv.cache import build_attention_metadata

    g = torch.Generator().manual_seed(1)
    ctx_lens, bs, D = [9, 13, 4, 7], 4, 8
    be = get_attention_backend("torch")
    seqs, tables, slots = _paged_case(g, bs, ctx_lens, q_lens)
    meta = build_attention_metadata(slots, tables, q_lens, ctx_lens, "cpu")
    assert meta.max_query_len == max(q_lens) and meta.decode_only == (max(q_lens) == 1)
    kw = {"sliding_window": window} if window else {}
    q = torch.cat([s[2] for s in seqs])
    for layer in range(2):
        sign = 1.0 if layer == 0 else -2.0  # the second layer's K/V differ
        kc, vc = torch.zeros(64, bs, 2, D), torch.zeros(64, bs, 2, D)
        k_all = torch.cat([s[0] for s in seqs]) * sign
        v_all = torch.cat([s[1] for s in seqs]) * sign
        be.reshape_and_cache(k_all, v_all, kc, vc, torch.tensor(slots), meta=meta)
        refs = [causal_attention(qq[None], k[None] * sign, v[None] * sign, window)[0]
                for k, v, qq in seqs]
        if meta.decode_only:
            out = be.decode(q, kc, vc, meta.block_tables, meta.context_lens, D ** -0.5,
                            meta=meta, **kw)
        else:
            out = be.prefill(q, kc, vc, meta.block_tables, meta.query_start_loc,
                             meta.context_lens, D ** -0.5, meta=meta, **kw)
        torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_int8_cache_dequantizes_what_it_reads():
    """With scales the backend stores quantize_kv_per_head(K/V) and attends over the
    dequantized values: equal to plain attention over dequantize(quantize(K/V))."""
    from labkit.quant.kv_int8 import dequantize_kv_per_head, quantize_kv_per_head

    g = torch.Generator().manual_seed(2)
    ctx_lens, q_lens, bs, D = [9, 13, 1, 7], [3, 1, 1, 7], 4, 8
    be = get_attention_backend("torch")
    seqs, tables, slots = _paged_case(g, bs, ctx_lens, q_lens)
    kc, vc = torch.zeros(64, bs, 2, D, dtype=torch.int8), torch.zeros(64, bs, 2, D,
                                                                      dtype=torch.int8)
    ks, vs = torch.zeros(64, bs, 2, dtype=torch.float16), torch.zeros(64, bs, 2,
                                                                      dtype=torch.float16)
    be.reshape_and_cache(torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]),
                         kc, vc, torch.tensor(slots), k_scale=ks, v_scale=vs)
    rt = lambda x: dequantize_kv_per_head(*quantize_kv_per_head(x))  # noqa: E731
    refs = [causal_attention(q[None], rt(k)[None], rt(v)[None])[0] for k, v, q in seqs]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = be.prefill(torch.cat([s[2] for s in seqs]), kc, vc, bt, qsl,
                     torch.tensor(ctx_lens, dtype=torch.int32), D ** -0.5, k_scale=ks,
                     v_scale=vs)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    plain = [causal_attention(q[None], k[None], v[None])[0] for k, v, q in seqs]
    assert not torch.allclose(out, torch.cat(plain), atol=1e-5)  # quantization is visible
