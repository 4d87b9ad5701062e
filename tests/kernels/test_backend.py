"""TritonBackend: the engine's AttentionBackend protocol, equal to the torch backend."""

import inspect

import torch
from labkit.kernels.backend import TritonBackend
from paged_fixtures import make_paged

from labkit.kv.attention import AttentionBackend, TorchBackend, get_attention_backend


def test_protocol_signatures_match():
    assert get_attention_backend("triton").name == "triton"
    assert isinstance(get_attention_backend("triton"), TritonBackend)
    for method in ("reshape_and_cache", "decode", "prefill"):
        want = list(inspect.signature(getattr(AttentionBackend, method)).parameters)
        sig = inspect.signature(getattr(AttentionBackend, method)).parameters
        required = [p for p in want if sig[p].default is inspect.Parameter.empty]
        for backend in (TritonBackend, TorchBackend):
            params = inspect.signature(getattr(backend, method)).parameters
            # positional ones in the protocol's order; the optional ones (meta, the INT8
            # scales) are passed by keyword, so the backend only has to take them
            assert list(params)[:len(required)] == required, (backend.__name__, method)
            assert set(want) <= set(params), (backend.__name__, method, set(want) - set(params))


def test_write_then_attend_equals_torch_backend():
    """One engine-like step: store new K/V through slot_mapping, then prefill + decode."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 32, 16
    k_cache, v_cache, bt, _, _ = make_paged([40, 25], hkv, d, bs, torch.float32, seed=2)
    k2, v2 = k_cache.clone(), v_cache.clone()
    ctx = torch.tensor([40, 25], dtype=torch.int32)
    positions = torch.cat([torch.arange(28, 40), torch.arange(25)])
    seq = torch.tensor([0] * 12 + [1] * 25)
    slots = (bt[seq, positions // bs].long() * bs + positions % bs)
    key, value = (torch.randn(37, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(37, hq, d, generator=gen)
    qsl = torch.tensor([0, 12, 37], dtype=torch.int32)
    tri, ref = TritonBackend(), TorchBackend()
    tri.reshape_and_cache(key, value, k_cache, v_cache, slots)
    ref.reshape_and_cache(key, value, k2, v2, slots)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    torch.testing.assert_close(tri.prefill(q, k_cache, v_cache, bt, qsl, ctx, 0.2),
                               ref.prefill(q, k2, v2, bt, qsl, ctx, 0.2), atol=2e-5, rtol=0)
    qd = torch.randn(2, hq, d, generator=gen)
    torch.testing.assert_close(tri.decode(qd, k_cache, v_cache, bt, ctx, 0.2),
                               ref.decode(qd, k2, v2, bt, ctx, 0.2), atol=2e-5, rtol=0)
