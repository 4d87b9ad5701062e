"""paged_prefill_attention: varlen causal chunks over cached blocks, against references."""

import pytest
import torch
from labkit.kernels.paged_attention import paged_attention_decode
from labkit.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from paged_fixtures import TOL, make_paged

from labkit.kv.attention import TorchBackend

CASES = [  # (context lens, query lens, Hq, Hkv, D, block_size, dtype)
    ([19, 40], [19, 40], 2, 2, 64, 16, torch.float32),        # plain prefill, GQA 1
    ([50, 33, 7], [13, 1, 7], 4, 2, 64, 16, torch.float16),   # chunk after a prefix, q_len 1
    ([70, 21], [70, 5], 8, 2, 128, 32, torch.bfloat16),       # GQA 4, D 128, block 32, >1 tile
    ([48, 20], [0, 20], 4, 1, 64, 32, torch.float32),         # a sequence with no new tokens
]


def _case(ctx_lens, q_lens, hq, hkv, d, bs, dtype, seed):
    k_cache, v_cache, bt, ctx, g = make_paged(ctx_lens, hkv, d, bs, dtype, seed)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, bt, qsl, ctx


@pytest.mark.parametrize("ctx_lens,q_lens,hq,hkv,d,bs,dtype", CASES)
def test_prefill_matches_reference(ctx_lens, q_lens, hq, hkv, d, bs, dtype):
    q, k_cache, v_cache, bt, qsl, ctx = _case(ctx_lens, q_lens, hq, hkv, d, bs, dtype, seed=d)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, d**-0.5)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, qsl, ctx, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


def test_prefill_matches_engine_torch_backend():
    """Independent reference: the engine's own torch backend (padded batch, its own masks)."""
    q, k_cache, v_cache, bt, qsl, ctx = _case([45, 30, 9], [20, 1, 9], 4, 2, 32, 16,
                                              torch.float32, seed=11)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.2)
    ref = TorchBackend().prefill(q, k_cache, v_cache, bt, qsl, ctx, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_prefill_of_one_token_equals_decode():
    q, k_cache, v_cache, bt, qsl, ctx = _case([23, 64], [1, 1], 4, 2, 64, 16, torch.float32, 4)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.125)
    dec = paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.125)
    torch.testing.assert_close(out, dec, atol=2e-6, rtol=0)


def test_prefill_causality():
    """Changing a later key must not change an earlier query's output."""
    q, k_cache, v_cache, bt, qsl, ctx = _case([30], [30], 2, 2, 16, 16, torch.float32, 6)
    before = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.25)
    k_cache[bt[0, 1], 10] += 5.0  # key position 26
    after = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.25)
    torch.testing.assert_close(after[:26], before[:26], atol=0, rtol=0)
    assert not torch.allclose(after[26:], before[26:])


def test_prefill_rejects_bad_query_start_loc():
    q, k_cache, v_cache, bt, qsl, ctx = _case([5, 6], [5, 6], 2, 2, 16, 16, torch.float32, 1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, bt, qsl[:2], ctx, 1.0)


@pytest.mark.parametrize("window", [1, 5, 8, 40])
@pytest.mark.parametrize("ctx_lens,q_lens,bs", [([50, 33, 7], [13, 1, 7], 16),   # chunk + prefix
                                                 ([90, 21], [90, 5], 8)])          # > 1 query tile
def test_prefill_sliding_window_matches_references(window, ctx_lens, q_lens, bs):
    """Each query sees only its last ``window`` keys: against the plain reference and the
    engine's torch backend (its own masks), for windows shorter and longer than the chunks."""
    q, k_cache, v_cache, bt, qsl, ctx = _case(ctx_lens, q_lens, 4, 2, 16, bs, torch.float32,
                                              seed=window)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.25,
                                  sliding_window=window)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, qsl, ctx, 0.25,
                                      sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    eng = TorchBackend().prefill(q, k_cache, v_cache, bt, qsl, ctx, 0.25, sliding_window=window)
    torch.testing.assert_close(out, eng, atol=2e-5, rtol=0)
    if window < min(ctx_lens):  # the window really cuts: full attention differs
        full = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.25)
        assert not torch.allclose(out, full)
