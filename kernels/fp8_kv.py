"""FP8 (e4m3) KV cache pieces the attention kernels share: e4m3 bits written and read by hand.

The layout is the INT8 cache's (``labkit.kv.ops``, ``kv_cache_dtype="fp8"``): caches
``[num_blocks, block_size, Hkv, D]`` of ``torch.float8_e4m3fn`` plus fp16 scales
``[num_blocks, block_size, Hkv]``, value = code * scale, each (token, head)'s absmax scaled to 448
(e4m3's largest finite value). The kernels see the caches as **uint8** (:func:`kernel_view`) and
do the format's arithmetic themselves. An e4m3fn byte is ``s eeee mmm``::

    value = (-1)^s * 2^(e - 7) * (1 + m / 8)     e = 1 .. 15   (s 1111 111 is NaN, no inf)
    value = (-1)^s * 2^-6      * (m / 8)         e = 0         (subnormals, and +-0)

Why by hand rather than ``tl.float8e4nv`` pointers and ``.to()``:

- **Reading** (:func:`e4m3_to_fp16`): fp16 is ``s eeeee mmmmmmmmmm`` with exponent bias 15, so
  moving e4m3's 7 low bits up by 7 into an fp16 gives the same value times ``2^(7 - 15)``, exactly,
  subnormals included (e4m3's subnormals land on fp16's). That is a shift, two masks and an OR
  per element, and the ``2^8`` goes into the per-token scale the kernels already apply to the
  score and probability tiles (``int8_kv.load_token_scales``). It runs on any GPU (Triton's
  native fp8e4nv needs sm_89+) and in the interpreter. Hopper's own cvt is not faster by much
  here: decode waits on memory, not on these integer ops.
- **Writing** (:func:`quantize_rows_fp8`): the codes must equal the torch backend's,
  ``(x / scale).clamp(+-448).to(float8_e4m3fn)``, which rounds to nearest, ties to even. Triton
  3.9's interpreter rounds an fp32 -> fp8e4nv conversion half *away* from zero and, when the
  rounding carries into the exponent, drops the carry (-124 becomes -64; measured against every
  e4m3 midpoint), so ``.to(tl.float8e4nv)`` gives other codes on CPU than on a GPU. Rounding by
  hand on the fp32 grid (``2^(e-3)`` steps, exact) and packing the bits ourselves gives torch's
  codes bit for bit on both.

Bytes: ``D + 2`` per (token, head) for K or for V, as INT8; the error is relative (3 mantissa
bits, within 2^-4 of each value) where INT8's is absolute (half of absmax / 127).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kv.ops import FP8_KV_DTYPE

# fp16's exponent bias (15) minus e4m3's (7): e4m3_to_fp16 gives value / 2^8; the scales undo it.
FP8_DECODE_SCALE = tl.constexpr(256.0)  # a constexpr: @jit code reads it


@triton.jit
def round_half_even(r):
    """fp32 -> the nearest integer, ties to even (torch.round's rule), spelled out with floor
    because that is exact everywhere (a GPU and the interpreter); |r| < 2^23."""
    f = tl.floor(r)
    frac = r - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def e4m3_to_fp16(bits):
    """uint8 e4m3fn codes -> their values / 256 as fp16, exactly (see the module docstring): the
    sign moves from bit 7 to bit 15, ``eeee mmm`` from bits 0-6 to bits 7-13. NaN codes
    (``x 1111 111``) read as 480 / 256, not NaN; only a zero scale writes them (below)."""
    b = bits.to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)


@triton.jit
def encode_e4m3(r):
    """fp32 r with |r| <= 448 -> its e4m3fn code (uint8), rounded to nearest, ties to even.

    With ``e = max(floor(log2 |r|), -6)`` (read from r's exponent bits, exact) e4m3's grid step
    is ``2^(e-3)``: n = round(|r| / step) is 8..16 for a normal value, 0..8 for a subnormal,
    and the code's low 7 bits are ``(e + 6) * 8 + n``. That one formula covers every case: n = 16
    (a carry) is exponent e + 1 with mantissa 0, and n = 8 at e = -6 is the smallest normal.
    """
    a = tl.abs(r)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): a * it is exact
    n = round_half_even(a * inv_step).to(tl.int32)
    code = (e + 6) * 8 + n
    sign = (r.to(tl.int32, bitcast=True) >> 24) & 0x80  # -0.0 keeps its sign, as torch's
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_rows_fp8(x):
    """x [H, D] (padding = 0) -> (e4m3fn codes as uint8 [H, D], fp16 scales [H]), bit for bit
    ``labkit.kv.ops.quantize_kv_per_head(x, torch.float8_e4m3fn)``:

        scale = fp16(max(absmax / 448, 2**-24));  code = e4m3_rne(clamp(x / scale, +-448))

    ``div_rn`` is IEEE division as torch's. The floor 2**-24 (``ops.KV_SCALE_MIN``, fp16's
    smallest subnormal) keeps the scale non-zero: an all-zero row encodes as zeros, not 0 / 0.
    """
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # 448: ops.FP8_MAX; 2**-24: ops.KV_SCALE_MIN
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 5.960464477539063e-08).to(tl.float16)
    s = scale.to(tl.float32)[:, None]
    zero = s == 0.0
    r = tl.math.div_rn(x, tl.where(zero, 1.0, s))
    r = tl.minimum(tl.maximum(r, -448.0), 448.0)
    r = tl.where(zero, tl.where(x > 0, 448.0, tl.where(x < 0, -448.0, 0.0)), r)
    code = tl.where(zero & (x == 0.0), 0xFF, encode_e4m3(r).to(tl.int32))
    return code.to(tl.uint8), scale


def is_fp8(cache: torch.Tensor) -> bool:
    """An e4m3 cache (``kv_cache_dtype="fp8"``); False on a torch without float8."""
    return FP8_KV_DTYPE is not None and cache.dtype == FP8_KV_DTYPE


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel receives for a cache: an e4m3 cache as its bytes (uint8, same storage and
    strides), which is also how the kernels tell it from an INT8 one at compile time
    (``k_cache_ptr.dtype.element_ty == tl.uint8``); any other cache unchanged."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache
