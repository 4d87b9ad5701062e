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
