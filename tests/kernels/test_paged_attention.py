"""paged_attention_decode (split and unsplit) against plain-PyTorch references."""

import pytest
import torch
from labkit.kernels.paged_attention import (
    default_num_splits,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from paged_fixtures import TOL, make_paged

CASES = [  # (lens, Hq, Hkv, D, block_size, dtype, num_splits)
    ([1, 17, 50], 4, 4, 64, 16, torch.float32, 1),      # GQA 1, odd lengths, one-token context
    ([33, 16, 70], 4, 2, 64, 16, torch.float16, 3),     # GQA 2, full and partial last blocks
    ([65, 7], 8, 2, 128, 32, torch.bfloat16, 1),        # GQA 4, D 128, block 32
    ([129, 40, 3], 8, 2, 64, 32, torch.bfloat16, None),  # automatic split
    ([100, 5], 4, 1, 128, 16, torch.float32, 7),        # many splits, some empty for seq 2
]


@pytest.mark.parametrize("lens,hq,hkv,d,bs,dtype,splits", CASES)
def test_decode_matches_reference(lens, hq, hkv, d, bs, dtype, splits):
    k_cache, v_cache, bt, ctx, g = make_paged(lens, hkv, d, bs, dtype, seed=len(lens) + d)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    scale = d**-0.5
    out = paged_attention_decode(q, k_cache, v_cache, bt, ctx, scale, num_splits=splits)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


def test_decode_split_equals_unsplit_and_reads_only_context():
    """Garbage past each context and in unused blocks must not leak into the result."""
    k_cache, v_cache, bt, ctx, g = make_paged([45, 90], 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(2, 4, 64, generator=g)
    one = paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.125, num_splits=1)
    k_cache[bt[0, 2], 13:] = 1e4  # positions 45.. of sequence 0, past its context
    v_cache[bt[0, 2], 13:] = float("nan")
    k_cache[-1] = float("nan")  # a block nobody owns
    for splits in (2, 5):
        out = paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.125, num_splits=splits)
        torch.testing.assert_close(out, one, atol=2e-6, rtol=0)


def test_decode_bf16_dot_is_not_garbage():
    """triton 3.9's interpreter returns garbage from tl.dot on bf16 operands; the kernels cast to
    fp32 there. Large-magnitude values make a wrong dot obvious."""
    k_cache, v_cache, bt, ctx, g = make_paged([64], 1, 64, 16, torch.bfloat16, seed=5)
    q = (torch.randn(1, 2, 64, generator=g) * 3).bfloat16()
    out = paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.125, num_splits=1)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, ctx, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=0)


def test_reference_matches_sdpa():
    """The reference itself against torch SDPA on hand-gathered contiguous K/V."""
    k_cache, v_cache, bt, ctx, g = make_paged([37], 2, 16, 16, torch.float32, seed=9)
    q = torch.randn(1, 4, 16, generator=g)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, ctx, 0.25)
    k = torch.cat([k_cache[int(b)] for b in bt[0, :3]])[:37]  # [37, Hkv, D]
    v = torch.cat([v_cache[int(b)] for b in bt[0, :3]])[:37]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None], k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), scale=0.25)[:, 0]
    torch.testing.assert_close(ref[0], sdpa, atol=1e-5, rtol=0)


def test_default_num_splits():
    assert default_num_splits(64, 8, 4096, num_sms=132) == 1  # batch fills the GPU
    assert default_num_splits(1, 8, 16384, num_sms=132) == 33
    assert default_num_splits(1, 8, 128, num_sms=132) == 1  # too short to split


def test_decode_rejects_bad_input():
    k_cache, v_cache, bt, ctx, g = make_paged([5], 2, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        paged_attention_decode(torch.randn(1, 3, 16), k_cache, v_cache, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_decode(torch.randn(1, 4, 8), k_cache, v_cache, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_decode(torch.randn(1, 4, 16).half(), k_cache, v_cache, bt, ctx, 1.0)


@pytest.mark.parametrize("window", [1, 6, 64])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sliding_window_reads_only_the_window(window, splits):
    """A windowed query equals the reference and never reads keys before its window: NaN put
    there (and in splits wholly before it) must not reach the output."""
    k_cache, v_cache, bt, ctx, g = make_paged([100, 5, 37], 2, 16, 8, torch.float32, seed=window)
    q = torch.randn(3, 4, 16, generator=g)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, ctx, 0.25, sliding_window=window)
    if window < 37:
        n = 100 - window  # sequence 0's keys 0 .. n-1 lie before its window
        k_cache[bt[0, : n // 8]] = float("nan")
        v_cache[bt[0, : n // 8]] = float("nan")
    out = paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.25, num_splits=splits,
                                 sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    if window < 37:
        full = paged_attention_decode_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), bt,
                                          ctx, 0.25)
        assert not torch.allclose(out, full)
