"""FP8 (e4m3) KV cache through the Triton kernels (interpreter on CPU).

- e4m3's bits by hand (kernels/fp8_kv.py): encoding equals torch's ``.to(float8_e4m3fn)`` bit
  for bit on every code, every midpoint between neighbours (the ties) and just either side of
  them, subnormals and -0.0; decoding is exact for every finite code; hand-read cases.
- reshape_and_cache quantizes exactly as ``labkit.kv.ops.quantize_kv_per_head(x,
  float8_e4m3fn)`` (the torch backend's path): the same codes and fp16 scales bit for bit.
- decode (split and unsplit) and prefill over e4m3 caches equal the torch backend's FP8
  attention, and the same kernels over the dequantized fp32 cache.
- bad input: ValueError with a message.
"""

import pytest
import torch
import triton
import triton.language as tl
from labkit.kernels.fp8_kv import e4m3_to_fp16, encode_e4m3
from labkit.kernels.paged_attention import paged_attention_decode
from labkit.kernels.paged_prefill import paged_prefill_attention
from labkit.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from paged_fixtures import TOL, make_paged

from labkit.kv.attention import TorchBackend
from labkit.kv.ops import dequantize_kv_per_head, quantize_kv_per_head

F8 = torch.float8_e4m3fn


@triton.jit
def _roundtrip_kernel(x_ptr, code_ptr, back_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    code = encode_e4m3(tl.load(x_ptr + offs))
    tl.store(code_ptr + offs, code)
    tl.store(back_ptr + offs, e4m3_to_fp16(code).to(tl.float32) * 256.0)


def _roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = triton.cdiv(x.numel(), 1024) * 1024
    xp = torch.zeros(n)
    xp[:x.numel()] = x
    code, back = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    _roundtrip_kernel[(n // 1024,)](xp, code, back, N=1024)
    return code[:x.numel()], back[:x.numel()]


def test_e4m3_encode_and_decode_equal_torch_bit_for_bit():
    every = torch.arange(256, dtype=torch.uint8).view(F8).float()
    grid = every[torch.isfinite(every)].unique()  # 253 values, -448 .. 448 (+-0 merge)
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: torch rounds them to the even code
    eps = mids.abs() * 2.0 ** -20
    rand = (torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 448
    x = torch.cat([grid, mids, mids + eps, mids - eps, rand, rand * 1e-3,
                   torch.tensor([-0.0, 1e-30, -1e-30, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -6])])
    code, back = _roundtrip(x)
    want = x.to(F8)
    assert torch.equal(code, want.view(torch.uint8))
    assert torch.equal(back, want.float())
    # a tie really is a tie, and half-away-from-zero would give other codes (what Triton's
    # interpreter's own fp32 -> fp8e4nv cast does, see fp8_kv's docstring)
    away = torch.where(mids > 0, grid[1:], grid[:-1])
    assert not torch.equal(mids.to(F8).float(), away)


def test_e4m3_by_hand():
    """Codes read off the bits: s eeee mmm, bias 7; subnormals 2^-6 * m / 8."""
    x = torch.tensor([1.0, -1.5, 448.0, 2.0 ** -9, 2.0 ** -6, 0.4375, -0.0, 17.0, 19.0])
    code, back = _roundtrip(x)
    assert code.tolist() == [0b0_0111_000, 0b1_0111_100, 0b0_1111_110, 0b0_0000_001,
                             0b0_0001_000, 0b0_0101_110, 0b1_0000_000,
                             0b0_1011_000, 0b0_1011_010]  # 17 -> 16 (tie, even), 19 -> 20
    assert back.tolist() == [1.0, -1.5, 448.0, 2.0 ** -9, 2.0 ** -6, 0.4375, -0.0, 16.0, 20.0]


def _tie_rows(n: int, heads: int, dim: int) -> torch.Tensor:
    """fp32 rows whose x / scale land exactly on e4m3 midpoints: with absmax 448 * s the scale is
    s (an fp16 value), and x = m * s for a midpoint m is exact in fp32 (<= 5 + 11 bits)."""
    every = torch.arange(256, dtype=torch.uint8).view(F8).float()
    grid = every[torch.isfinite(every)].unique()
    mids = ((grid[1:] + grid[:-1]) / 2)[-dim:]
    x = torch.zeros(n, heads, dim)
    for i in range(n):
        s = float(torch.tensor(0.01 + 0.07 * i).half())
        x[i, 0] = mids * s
        x[i, 0, 0] = 448 * s
    return x


@pytest.mark.parametrize("heads,dim,bs,dtype", [
    (2, 32, 8, torch.float32), (3, 24, 4, torch.bfloat16), (1, 16, 8, torch.float16)])
def test_reshape_and_cache_fp8_is_bit_exact(heads, dim, bs, dtype):
    g = torch.Generator().manual_seed(heads)
    n, num_blocks = 13, 5
    key = (torch.randn(n, heads, dim, generator=g) * 3).to(dtype)
    value = torch.randn(n, heads, dim, generator=g).to(dtype)
    if dtype == torch.float32:  # x / scale exactly between two e4m3 values: the ties are real
        key[:3] = _tie_rows(3, heads, dim)
        r = key[:3, 0] / quantize_kv_per_head(key, F8)[1][:3, 0, None].float()
        assert bool((r[:, 1:] != r[:, 1:].to(F8).float()).all()) and r[0, 0] == 448
    value[4, 0] = 0.0  # all-zero row: the 2**-24 scale floor, codes 0 (not 0 / 0 = NaN)
    value[5, -1] = 1e-7  # a row at the scale floor (absmax / 448 < 2**-24)
    value[5, -1, ::3] = 0.0
    value[5, -1, 1::3] *= -1
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[[2, 7]] = -1  # padding tokens
    caches = [torch.full((num_blocks, bs, heads, dim), 3.0).to(F8) for _ in range(6)]
    scales = [torch.full((num_blocks, bs, heads), 9.0, dtype=torch.float16) for _ in range(6)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, scales[0], scales[1])
    TorchBackend().reshape_and_cache(key, value, caches[2], caches[3], slots, scales[2],
                                     scales[3])
    reshape_and_cache_ref(key, value, caches[4], caches[5], slots, scales[4], scales[5])
    bits = [c.view(torch.uint8) for c in caches]
    for i in (2, 4):
        for j in (0, 1):
            assert torch.equal(bits[j], bits[i + j]) and torch.equal(scales[j], scales[i + j])
    kq, ks = quantize_kv_per_head(key, F8)  # and the quantizer's own output at the slots
    keep = slots >= 0
    got = bits[0].view(-1, heads, dim)[slots[keep]]
    assert torch.equal(got, kq[keep].view(torch.uint8))
    assert torch.equal(scales[0].view(-1, heads)[slots[keep]], ks[keep])
    flat_v, flat_vs = bits[1].view(-1, heads, dim), scales[1].view(-1, heads)
    assert flat_vs[slots[4], 0] == 2 ** -24 and bool((flat_v[slots[4], 0] == 0).all())
    vq, vs = quantize_kv_per_head(value, F8)  # the floor row: the quantizer's codes, no NaN
    assert flat_vs[slots[5], -1] == 2 ** -24 == vs[5, -1]
    assert torch.equal(flat_v[slots[5], -1], vq[5, -1].view(torch.uint8))
    assert not vq[5, -1].float().isnan().any() and len(set(vq[5, -1].float().tolist())) == 3
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((bits[0].view(-1, heads, dim)[untouched] == 0x44).all())  # 3.0, as filled


def _fp8_cache(lens, hkv, dim, bs, seed):
    kc, vc, bt, cl, g = make_paged(lens, hkv, dim, bs, torch.float32, seed)
    kq, ks = quantize_kv_per_head(kc, F8)
    vq, vs = quantize_kv_per_head(vc, F8)
    return kq, vq, ks, vs, bt, cl, g


@pytest.mark.parametrize("hq,hkv,dim,bs,dtype", [
    (4, 2, 32, 8, torch.float32), (4, 1, 16, 4, torch.bfloat16), (2, 2, 24, 8, torch.float16)])
def test_decode_and_prefill_fp8_match_torch_backend(hq, hkv, dim, bs, dtype):
    spec = [(5, 5), (bs + 2, 3 * bs + 1), (1, 2 * bs + 3)]  # (q_len, ctx) as in the engine
    lens = [c for _, c in spec]
    kq, vq, ks, vs, bt, cl, g = _fp8_cache(lens, hkv, dim, bs, seed=hq + dim)
    scale = dim ** -0.5
    kw = {"k_scale": ks, "v_scale": vs}
    kd, vd = dequantize_kv_per_head(kq, ks), dequantize_kv_per_head(vq, vs)
    qd = torch.randn(len(lens), hq, dim, generator=g).to(dtype)
    want = TorchBackend().decode(qd, kq, vq, bt, cl, scale, **kw).float()
    fp = paged_attention_decode(qd.float(), kd, vd, bt, cl, scale, num_splits=1)
    for splits in (1, 3):
        got = paged_attention_decode(qd, kq, vq, bt, cl, scale, num_splits=splits, block_n=16,
                                     **kw).float()
        assert (got - want).abs().max() <= TOL[dtype], splits
        if dtype == torch.float32:  # e4m3 tiles change only the loads
            assert (got - fp).abs().max() <= 1e-5, splits
    qsl = torch.tensor([0, *torch.tensor([n for n, _ in spec]).cumsum(0).tolist()],
                       dtype=torch.int32)
    qp = torch.randn(int(qsl[-1]), hq, dim, generator=g).to(dtype)
    want = TorchBackend().prefill(qp, kq, vq, bt, qsl, cl, scale, **kw).float()
    got = paged_prefill_attention(qp, kq, vq, bt, qsl, cl, scale, block_m=16, block_n=16,
                                  **kw).float()
    assert (got - want).abs().max() <= TOL[dtype]
    if dtype == torch.float32:
        fp = paged_prefill_attention(qp, kd, vd, bt, qsl, cl, scale, block_m=16, block_n=16)
        assert (got - fp).abs().max() <= 1e-5


def test_bad_fp8_input_is_a_value_error():
    kq, vq, ks, vs, bt, cl, g = _fp8_cache([5, 9], 2, 16, 8, seed=0)
    q = torch.randn(2, 4, 16, generator=g)
    with pytest.raises(ValueError, match="needs both int8 caches and .* float8_e4m3fn"):
        paged_attention_decode(q, kq, vq, bt, cl, 0.25)  # codes without their scales
    with pytest.raises(ValueError, match="must both be int8 or both float8_e4m3fn"):
        paged_attention_decode(q, kq, vq.view(torch.int8), bt, cl, 0.25, k_scale=ks,
                               v_scale=vs)
    with pytest.raises(ValueError, match="key .quantized into an fp8 cache. must be"):
        reshape_and_cache(kq[0, :2], kq[0, :2], kq, vq, torch.tensor([0, 1]), ks, vs)
