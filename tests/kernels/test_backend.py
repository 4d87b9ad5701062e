"""TritonBackend: the engine's AttentionBackend protocol, equal to the torch backend."""

import inspect

import torch
from labkit.kernels.backend import TritonBackend
from paged_fixtures import make_paged

from labkit.kv.attention import AttentionBackend, TorchBackend, get_attention_backend


def _shape(fn) -> list[tuple]:
    """A signature without annotations: (name, kind, default) in order."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_protocol_signatures_match():
    """Both backends take exactly the protocol's parameters, in its order, with its defaults
    (the cache passes the scales positionally: an order mismatch would be a silent bug)."""
    assert get_attention_backend("triton").name == "triton"
    assert isinstance(get_attention_backend("triton"), TritonBackend)
    for method in ("reshape_and_cache", "decode", "prefill", "mla_decode"):
        want = _shape(getattr(AttentionBackend, method))
        for backend in (TritonBackend, TorchBackend):
            assert _shape(getattr(backend, method)) == want, (backend.__name__, method)


def test_signature_check_catches_a_swapped_argument():
    """Negative control: the comparison above fails for a backend that swaps two arguments."""

    class Swapped(TorchBackend):
        def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, v_scale=None,
                              k_scale=None, meta=None):
            return super().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping,
                                             k_scale, v_scale, meta)

    assert _shape(Swapped.reshape_and_cache) != _shape(AttentionBackend.reshape_and_cache)


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
