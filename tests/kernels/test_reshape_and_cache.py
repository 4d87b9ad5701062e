"""reshape_and_cache writes exactly the mapped slots and nothing else."""

import pytest
import torch
from labkit.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

from labkit.kv.attention import TorchBackend


@pytest.mark.parametrize("hkv,d,bs,dtype", [(2, 64, 16, torch.bfloat16),
                                            (3, 24, 32, torch.float32)])
def test_matches_references_with_padding_slots(hkv, d, bs, dtype):
    g = torch.Generator().manual_seed(hkv)
    n, num_blocks = 21, 6
    key = torch.randn(n, hkv, d, generator=g).to(dtype)
    value = torch.randn(n, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[[0, 5, 20]] = -1  # padding tokens
    caches = [torch.full((num_blocks, bs, hkv, d), 7.0, dtype=dtype) for _ in range(6)]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots)
    TorchBackend().reshape_and_cache(key, value, caches[4], caches[5], slots)
    for i in (2, 4):
        assert torch.equal(caches[0], caches[i]) and torch.equal(caches[1], caches[i + 1])
    flat = caches[0].view(-1, hkv, d)
    assert torch.equal(flat[slots[1]], key[1])  # by hand: token 1 landed in its slot
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (flat[untouched] == 7.0).all()


def test_strided_views_from_a_fused_qkv():
    """key/value are often column slices of one qkv projection: non-contiguous rows."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 4 + 2 + 2, 16, generator=g)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    kc, vc = torch.zeros(3, 16, 2, 16), torch.zeros(3, 16, 2, 16)
    slots = torch.arange(9) * 5
    reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 16)[slots], key)
    assert torch.equal(vc.view(-1, 2, 16)[slots], value)


def test_rejects_mismatched_shapes():
    kc = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), kc, kc.clone(),
                          torch.arange(2))
    with pytest.raises(ValueError, match="do not match"):
        reshape_and_cache(torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), kc, kc.clone(),
                          torch.arange(3))
