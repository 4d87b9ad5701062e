"""Attention sinks (gpt-oss): the reference against a hand-computed softmax with the extra
logit, and the paged torch backend (prefill, decode, sliding windows, GQA) against the reference;
the Triton backend gives the same answer (the kernels' own tests:
tests/kernels/test_attention_sinks_kernels.py)."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.kv.attention import get_attention_backend
from labkit.model.llama import causal_attention


def test_reference_equals_hand_softmax_with_sink_logit():
    """One head, D = 1, three keys: weights exp(s_j) / (exp(sink) + sum exp(s_i))."""
    q = torch.tensor([[[[2.0]]]])  # [B=1, T=1, H=1, D=1]
    k = torch.tensor([1.0, -1.0, 0.5]).view(1, 3, 1, 1)
    v = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    sink = 0.7
    out = causal_attention(q, k, v, sinks=torch.tensor([sink]))
    s = [2.0 * kj for kj in (1.0, -1.0, 0.5)]  # scale 1/sqrt(1)
    denom = math.exp(sink) + sum(math.exp(x) for x in s)
    want = sum(math.exp(x) / denom * vj for x, vj in zip(s, (10.0, 20.0, 30.0)))
    assert out.item() == pytest.approx(want, rel=1e-5)  # float32 softmax vs float64 math
    # a window of 1: the query sees its own key only (the last), the sink still takes its share
    out = causal_attention(q, k, v, sliding_window=1, sinks=torch.tensor([sink]))
    assert out.item() == pytest.approx(math.exp(1.0) / (math.exp(sink) + math.exp(1.0)) * 30,
                                       rel=1e-5)


def test_very_negative_sink_is_plain_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g),
               torch.randn(2, 5, 2, 8, generator=g))
    got = causal_attention(q, k, v, 3, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(got, causal_attention(q, k, v, 3), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_prefill_and_decode_with_sinks_match_reference(window):
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D, nb, bs = 4, 2, 8, 48, 4
    ctx_lens, q_lens = [9, 13, 1, 7], [3, 1, 1, 7]  # chunked prefill, decodes, a whole prompt
    sinks = torch.randn(Hq, generator=g) * 2
    be = get_attention_backend("torch")
    kc, vc = torch.zeros(nb, bs, Hkv, D), torch.zeros(nb, bs, Hkv, D)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, qs, refs = [], [], []
    for S, T in zip(ctx_lens, q_lens):
        k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
        q = torch.randn(T, Hq, D, generator=g)
        table = [perm.pop() for _ in range(-(-S // bs))]
        pos = torch.arange(S)
        be.reshape_and_cache(k, v, kc, vc, torch.tensor(table)[pos // bs] * bs + pos % bs)
        tables.append(table)
        qs.append(q)
        refs.append(causal_attention(q[None], k[None], v[None], window, sinks=sinks)[0])
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    kw = {"sliding_window": window, "sinks": sinks}
    out = be.prefill(torch.cat(qs), kc, vc, bt, qsl, ctx, D ** -0.5, **kw)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    dec = be.decode(torch.stack([q[-1] for q in qs]), kc, vc, bt, ctx, D ** -0.5, **kw)
    torch.testing.assert_close(dec, torch.stack([r[-1] for r in refs]), atol=1e-5, rtol=1e-5)
    plain = be.decode(torch.stack([q[-1] for q in qs]), kc, vc, bt, ctx, D ** -0.5,
                      sliding_window=window)
    assert (plain - dec).abs().max() > 1e-3  # the sinks changed the answer


def test_triton_backend_takes_sinks():
    """The Triton backend gives the torch backend's answer with sinks (the kernels' own tests
    are in tests/kernels/test_attention_sinks_kernels.py)."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 4, 1, 8, generator=g)
    q, sinks = torch.randn(1, 2, 8, generator=g), torch.tensor([0.5, -1.0])
    bt, ctx = torch.ones(1, 1, dtype=torch.int32), torch.full((1,), 3, dtype=torch.int32)
    outs = [get_attention_backend(be).decode(q, kc, vc, bt, ctx, 0.35, sinks=sinks)
            for be in ("torch", "triton")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
