"""INT8 KV cache through the Triton kernels (interpreter on CPU).

- reshape_and_cache quantizes exactly as labkit.quant's ``quantize_kv_per_head`` (the torch
  backend's path): same int8 codes and fp16 scales bit for bit, including rounding ties (torch
  rounds half to even), all-zero rows and rows at the scale floor (2**-24).
- decode (split and unsplit) and prefill over int8 caches agree with the torch backend's INT8
  attention, and with the fp kernels run on the dequantized cache.
- bad input: ValueError with a message.
"""

import pytest
import torch
from labkit.kernels.paged_attention import paged_attention_decode, paged_attention_decode_ref
from labkit.kernels.paged_prefill import paged_prefill_attention
from labkit.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from paged_fixtures import TOL, make_paged

from labkit.kv.attention import TorchBackend
from labkit.quant.kv_int8 import dequantize_kv_per_head, quantize_kv_per_head


def _tie_rows(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, heads, dim] whose head 0 hits exact .5 ties: with absmax 127 * s the scale is s, and
    (k + 0.5) * s / s = k + 0.5 for every k, even and odd. In fp32 the scales s are fp16 values
    whose reciprocal is inexact, so x * (1 / s) would miss some ties (a GPU's fast division
    too); bf16/fp16 inputs cannot hold those products, there s = 0.25."""
    x = torch.zeros(n, heads, dim)
    ks = torch.arange(dim) % 64 - 32  # even and odd integers
    for i in range(n):
        sc = float(torch.tensor(0.1 + 0.37 * i).half()) if dtype == torch.float32 else 0.25
        x[i, 0] = (ks + 0.5) * sc  # exact in fp32: <= 7 + 11 significant bits
        x[i, 0, 0] = 127 * sc
    return x.to(dtype)


def _quantize_inputs(n: int, heads: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, heads, dim, generator=g) * 3).to(dtype)
    value = torch.randn(n, heads, dim, generator=g).to(dtype)
    key[:4] = _tie_rows(4, heads, dim, dtype)
    value[4, 0] = 0.0  # all-zero row: the 2**-24 scale floor, codes 0
    value[5, -1] = 1e-7  # a row at the scale floor (absmax / 127 < 2**-24)
    value[5, -1, ::3] = 0.0
    value[5, -1, 1::3] *= -1
    return key, value


@pytest.mark.parametrize("heads,dim,bs,dtype", [
    (1, 64, 16, torch.float32), (4, 80, 8, torch.bfloat16), (2, 64, 8, torch.float16)])
def test_reshape_and_cache_int8_is_bit_exact(heads, dim, bs, dtype):
    n, num_blocks = 23, 5
    key, value = _quantize_inputs(n, heads, dim, dtype, seed=heads)
    # The ties are real: torch rounds them half to even, half-away-from-zero would differ.
    ts = key[:4, 0, :1].float() / 127
    r = key[:4, 0, 1:].float() / ts  # element 0 is the absmax, 127
    assert bool((r.frac().abs() == 0.5).all())
    assert not torch.equal(torch.round(r), torch.trunc(r + 0.5 * torch.sign(r)))
    if dtype == torch.float32:  # and a reciprocal instead of a division would move some
        assert not torch.equal(r, key[:4, 0, 1:].float() * (1 / ts))
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[[6, 11]] = -1  # padding tokens
    caches = [torch.full((num_blocks, bs, heads, dim), 55, dtype=torch.int8) for _ in range(6)]
    scales = [torch.full((num_blocks, bs, heads), 9.0, dtype=torch.float16) for _ in range(6)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, scales[0], scales[1])
    TorchBackend().reshape_and_cache(key, value, caches[2], caches[3], slots, scales[2],
                                     scales[3])
    reshape_and_cache_ref(key, value, caches[4], caches[5], slots, scales[4], scales[5])
    for i in (2, 4):
        for j in (0, 1):
            assert torch.equal(caches[j], caches[i + j]), (i, j)
            assert torch.equal(scales[j], scales[i + j]), (i, j)
    # by hand at the token slots: the quantizer's own output, ties even, special rows
    kq, ks = quantize_kv_per_head(key)
    vq, vs = quantize_kv_per_head(value)
    flat_k, flat_v = caches[0].view(-1, heads, dim), caches[1].view(-1, heads, dim)
    flat_ks, flat_vs = scales[0].view(-1, heads), scales[1].view(-1, heads)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], kq[keep]) and torch.equal(flat_v[slots[keep]],
                                                                       vq[keep])
    assert torch.equal(flat_ks[slots[keep]], ks[keep]) and torch.equal(flat_vs[slots[keep]],
                                                                       vs[keep])
    assert flat_ks[slots[0], 0] == (0.25 if dtype != torch.float32 else float(ts[0]))
    assert flat_k[slots[0], 0, :4].tolist() == [127, -30, -30, -28]  # -30.5, -29.5, -28.5
    assert flat_k[slots[0], 0, 32:36].tolist() == [0, 2, 2, 4]  # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert flat_vs[slots[4], 0] == 2 ** -24 and bool((flat_v[slots[4], 0] == 0).all())
    tiny = flat_v[slots[5], -1]  # at the floor: small codes, the quantizer's own
    assert flat_vs[slots[5], -1] == 2 ** -24
    assert torch.equal(tiny, quantize_kv_per_head(value, torch.int8)[0][5, -1])
    assert len(set(tiny.tolist())) == 3 and tiny.abs().max() < 127
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((flat_k[untouched] == 55).all()) and bool((flat_vs[untouched] == 9.0).all())


def _int8_cache(lens, hkv, dim, bs, seed):
    kc, vc, bt, cl, g = make_paged(lens, hkv, dim, bs, torch.float32, seed)
    kq, ks = quantize_kv_per_head(kc)
    vq, vs = quantize_kv_per_head(vc)
    return kq, vq, ks, vs, bt, cl, g


# (q heads, kv heads, head_dim, block_size, dtype): GQA 1 and 4, D 64/80, blocks 8/16
CASES = [(4, 4, 64, 16, torch.float32), (8, 2, 80, 8, torch.float32),
         (4, 1, 64, 8, torch.bfloat16), (2, 2, 80, 16, torch.float16)]


@pytest.mark.parametrize("hq,hkv,dim,bs,dtype", CASES)
def test_decode_int8_matches_torch_backend(hq, hkv, dim, bs, dtype):
    lens = [1, bs + 3, 5 * bs - 1, 70]  # partly filled last blocks, one exactly-one-token
    kq, vq, ks, vs, bt, cl, g = _int8_cache(lens, hkv, dim, bs, seed=hq + dim)
    q = torch.randn(len(lens), hq, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    want = TorchBackend().decode(q, kq, vq, bt, cl, scale, k_scale=ks, v_scale=vs).float()
    ref = paged_attention_decode_ref(q, kq, vq, bt, cl, scale, ks, vs).float()
    # the same kernel on the dequantized fp32 cache: int8 tiles change only the loads
    kd, vd = dequantize_kv_per_head(kq, ks), dequantize_kv_per_head(vq, vs)
    fp = paged_attention_decode(q.float(), kd, vd, bt, cl, scale, num_splits=1)
    for splits in (1, 3):
        got = paged_attention_decode(q, kq, vq, bt, cl, scale, num_splits=splits, k_scale=ks,
                                     v_scale=vs).float()
        assert (got - want).abs().max() <= TOL[dtype], splits
        assert (got - ref).abs().max() <= TOL[dtype], splits
        if dtype == torch.float32:
            assert (got - fp).abs().max() <= 1e-5, splits
    # and the quantization error is real but small against the unquantized cache
    kc, vc, *_ = make_paged(lens, hkv, dim, bs, torch.float32, hq + dim)
    exact = paged_attention_decode_ref(q.float(), kc, vc, bt, cl, scale)
    err = (want - exact).abs().max()
    assert 1e-5 < err < 0.05


@pytest.mark.parametrize("hq,hkv,dim,bs,dtype", CASES)
def test_prefill_int8_matches_torch_backend(hq, hkv, dim, bs, dtype):
    # (q_len, ctx): fresh prompt, chunk after a cached prefix, single token, odd long chunk
    spec = [(7, 7), (bs + 2, 3 * bs + 5), (1, 2 * bs + 1), (20, 45)]
    lens = [c for _, c in spec]
    kq, vq, ks, vs, bt, cl, g = _int8_cache(lens, hkv, dim, bs, seed=hq * dim)
    qsl = torch.tensor([0] + [sum(n for n, _ in spec[:i + 1]) for i in range(len(spec))],
                       dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    want = TorchBackend().prefill(q, kq, vq, bt, qsl, cl, scale, k_scale=ks,
                                  v_scale=vs).float()
    got = paged_prefill_attention(q, kq, vq, bt, qsl, cl, scale, block_m=16, block_n=16,
                                  k_scale=ks, v_scale=vs).float()
    assert (got - want).abs().max() <= TOL[dtype]
    if dtype == torch.float32:
        kd, vd = dequantize_kv_per_head(kq, ks), dequantize_kv_per_head(vq, vs)
        fp = paged_prefill_attention(q, kd, vd, bt, qsl, cl, scale, block_m=16, block_n=16)
        assert (got - fp).abs().max() <= 1e-5


def test_write_then_attend_like_the_engine():
    """reshape_and_cache (int8) then decode, both backends, from the same fp K/V."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, dim, bs, n = 4, 2, 64, 8, 19
    key, value = torch.randn(n, hkv, dim, generator=g), torch.randn(n, hkv, dim, generator=g)
    slots = torch.tensor([3 * bs + i for i in range(bs)] + [bs + i for i in range(n - bs)])
    bt = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    cl = torch.tensor([n], dtype=torch.int32)
    q = torch.randn(1, hq, dim, generator=g)
    outs = []
    for be in (TorchBackend(), None):
        kc, vc = torch.zeros(5, bs, hkv, dim, dtype=torch.int8), torch.zeros(5, bs, hkv, dim,
                                                                             dtype=torch.int8)
        ks, vs = torch.zeros(5, bs, hkv, dtype=torch.float16), torch.zeros(5, bs, hkv,
                                                                           dtype=torch.float16)
        if be is None:
            reshape_and_cache(key, value, kc, vc, slots, ks, vs)
            outs.append(paged_attention_decode(q, kc, vc, bt, cl, dim ** -0.5, k_scale=ks,
                                               v_scale=vs))
        else:
            be.reshape_and_cache(key, value, kc, vc, slots, ks, vs)
            outs.append(be.decode(q, kc, vc, bt, cl, dim ** -0.5, k_scale=ks, v_scale=vs))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-5)


def _bad_setup():
    kq, vq, ks, vs, bt, cl, g = _int8_cache([5, 9], 2, 16, 8, seed=0)
    q = torch.randn(2, 4, 16, generator=g)
    return q, kq, vq, ks, vs, bt, cl


@pytest.mark.parametrize("case,match", [
    ("no_scales", "needs both int8 caches and k_scale"),
    ("one_scale", "v_scale None"),
    ("scales_on_fp_cache", "needs both int8 caches"),
    ("fp32_scales", "k_scale must be fp16"),
    ("bad_shape", "v_scale must be k_scale and v_scale"),
    ("transposed", "same strides"),
])
def test_bad_int8_input_is_a_value_error(case, match):
    q, kq, vq, ks, vs, bt, cl = _bad_setup()
    kw = {"k_scale": ks, "v_scale": vs}
    if case == "no_scales":
        kw = {}
    elif case == "one_scale":
        kw = {"k_scale": ks}
    elif case == "scales_on_fp_cache":
        kq, vq = kq.float(), vq.float()
    elif case == "fp32_scales":
        kw["k_scale"] = ks.float()
    elif case == "bad_shape":
        kw["v_scale"] = vs[:, :4]
    elif case == "transposed":
        kw["v_scale"] = vs.transpose(0, 1).contiguous().transpose(0, 1)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    key = torch.randn(2, 2, 16)
    calls = [lambda: paged_attention_decode(q, kq, vq, bt, cl, 0.25, **kw),
             lambda: paged_prefill_attention(q, kq, vq, bt, qsl, cl, 0.25, **kw),
             lambda: reshape_and_cache(key, key, kq, vq, torch.tensor([0, 1]), **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()


def test_int8_cache_key_must_be_float():
    _, kq, vq, ks, vs, *_ = _bad_setup()
    with pytest.raises(ValueError, match="key .quantized into an int8 cache. must be"):
        reshape_and_cache(kq[0, :2], kq[0, :2], kq, vq, torch.tensor([0, 1]), ks, vs)


def test_reshape_and_cache_int8_exact_over_magnitudes():
    """512 tokens x 2 heads whose magnitudes span 1e-7 .. 1e4 (fp16 scales from the 2**-24 floor to
    normal, rounding near every fp16 boundary): still bit for bit the torch quantizer."""
    g = torch.Generator().manual_seed(11)
    n, heads, dim, bs = 512, 2, 64, 16
    mag = 10 ** (torch.rand(n, heads, 1, generator=g) * 11 - 7)
    key = torch.randn(n, heads, dim, generator=g) * mag
    value = torch.rand(n, heads, dim, generator=g) * mag  # one-signed rows
    slots = torch.randperm(n, generator=g)
    out = [torch.zeros(n // bs, bs, heads, dim, dtype=torch.int8) for _ in range(4)]
    sc = [torch.zeros(n // bs, bs, heads, dtype=torch.float16) for _ in range(4)]
    reshape_and_cache(key, value, out[0], out[1], slots, sc[0], sc[1])
    TorchBackend().reshape_and_cache(key, value, out[2], out[3], slots, sc[2], sc[3])
    assert int((sc[2] == 2 ** -24).sum()) > 0 and int((sc[2] > 1).sum()) > 0  # the range is covered
    for j in (0, 1):
        assert torch.equal(out[j], out[j + 2]) and torch.equal(sc[j], sc[j + 2]), j
