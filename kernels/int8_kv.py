"""INT8 KV cache pieces the attention kernels share: quantize on write, scale on read.

The layout is ``labkit.kv.ops``' per-(token, head) one, which the engine uses for
``kv_cache_dtype="int8"``: caches ``[num_blocks, block_size, Hkv, D]`` int8 plus fp16 scales
``[num_blocks, block_size, Hkv]``, value = code * scale. ``reshape_and_cache`` quantizes each new
token's head vector once (:func:`quantize_rows`); the decode and prefill kernels load int8 tiles
(:func:`load_kv_tile`) and fold each token's scale into the score and probability tiles
(:func:`load_token_scales`), which is the same as dequantizing K and V but cheaper. Each kernel
branches at compile time on its cache's element type
(``KV_INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8``), so a float cache compiles
the float kernel with no trace of the INT8 code (same loads, same MMAs on sm_90).

An FP8 (e4m3) cache (``kv_cache_dtype="fp8"``) goes through the same helpers: the same scales and
layout, its codes passed to the kernels as uint8 bytes (``KV_FP8: ... == tl.uint8``) that
:func:`load_kv_tile` decodes and :func:`load_token_scales` rescales (``labkit.kernels.fp8_kv``).

Why: decode reads the whole KV history every step and is memory-bound, so bytes read per
(token, kv head) set its speed: ``D + 2`` (int8 codes + one fp16 scale) instead of ``2 * D`` for
bf16, 1.94x fewer at D = 128. The cost is one int8 -> bf16 convert per element and two
multiplies per score (free next to the memory stall), and the quantization error: up to half a
step, ``absmax / 254``, per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from labkit.kernels._common import check
from labkit.kernels.fp8_kv import FP8_DECODE_SCALE, e4m3_to_fp16, round_half_even

from labkit.kv.ops import FP8_KV_DTYPE, dequantize_kv_per_head

SCALE_DTYPE = torch.float16  # as labkit.kv.ops.quantize_kv_per_head and the engine
QUANT_CACHE_DTYPES = (torch.int8, *((FP8_KV_DTYPE,) if FP8_KV_DTYPE is not None else ()))


@triton.jit
def quantize_rows(x):
    """x [H, D] (padding = 0) -> (int8 codes [H, D], fp16 scales [H]), bit for bit
    ``labkit.kv.ops.quantize_kv_per_head``:

        scale = fp16(max(absmax / 127, 2**-24));  code = clamp(round_half_even(x / scale), ±127)

    ``div_rn`` is IEEE division as torch's (a GPU's plain ``/`` is approximate); the rounding is
    spelled out with ``floor`` (``fp8_kv.round_half_even``) because that is exact everywhere (GPU
    and interpreter). The floor 2**-24 (``ops.KV_SCALE_MIN``, fp16's smallest subnormal) keeps the
    scale non-zero: an all-zero row encodes as zeros.
    """
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, 127.0), 5.960464477539063e-08).to(tl.float16)  # 2**-24
    s = scale.to(tl.float32)[:, None]
    zero = s == 0.0
    r = round_half_even(tl.math.div_rn(x, tl.where(zero, 1.0, s)))
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(zero, tl.where(x > 0, 127.0, tl.where(x < 0, -127.0, 0.0)), r)
    return r.to(tl.int8), scale


@triton.jit
def load_kv_tile(ptrs, kv_mask, KV_INT8: tl.constexpr, KV_FP8: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """One K or V tile [BLOCK_N, D] at ``ptrs`` (gathered through the block table by the
    caller). Float cache: loaded as it is. INT8: the codes, converted to the dot's dtype; codes
    in [-127, 127] are exact in bf16/fp16/fp32, so no rounding happens here. FP8 (uint8 bytes):
    each code's value / 256 (``fp8_kv.e4m3_to_fp16``), exact in those dtypes too (3 mantissa
    bits, exponents 2^-17 .. 2^0)."""
    x = tl.load(ptrs, mask=kv_mask, other=0)
    if KV_INT8:
        x = x.to(DOT_DTYPE)
    if KV_FP8:
        x = e4m3_to_fp16(x).to(DOT_DTYPE)
    return x


@triton.jit
def load_token_scales(scale_base, phys, in_blk, stride_sb, stride_ss, t_mask,
                      KV_FP8: tl.constexpr):
    """The tile's per-token scales [BLOCK_N] in fp32 (``scale_base`` already at the kv head),
    times 256 for an FP8 cache (undoing ``load_kv_tile``'s e4m3 / 256: exact, a power of two).

    They factor out of the dots because each belongs to one key/value row:
    ``q . (c_t * s_t) = (q . c_t) * s_t`` scales column t of S = Q K^T, and
    ``sum_t p_t * (c_t * s_t) = sum_t (p_t * s_t) * c_t`` scales column t of P before P V.
    So the kernels multiply the small [rows, BLOCK_N] score and probability tiles, not the
    [BLOCK_N, D] K and V tiles: BLOCK_N * rows multiplies per tile instead of 2 * BLOCK_N * D.
    """
    s = tl.load(scale_base + phys * stride_sb + in_blk * stride_ss, mask=t_mask, other=0.0)
    s = s.to(tl.float32)
    if KV_FP8:
        s = s * FP8_DECODE_SCALE
    return s


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """True for an INT8 or FP8 (e4m3) cache with valid scales, False for a float cache without;
    ValueError for anything in between (raw codes read without scales would be silently wrong)."""
    quant = any(c.dtype in QUANT_CACHE_DTYPES for c in (k_cache, v_cache))
    given = (k_scale is not None, v_scale is not None)
    if not quant and not any(given):
        return False
    want = (f"k_scale and v_scale [num_blocks, block_size, num_kv_heads] = "
            f"{list(k_cache.shape[:3])} fp16")
    check(quant and all(given), f"a quantized KV cache needs both int8 caches and {want} (or "
          f"both float8_e4m3fn caches and those scales); got caches {k_cache.dtype}/"
          f"{v_cache.dtype}, k_scale {'given' if given[0] else 'None'}, v_scale "
          f"{'given' if given[1] else 'None'}")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in QUANT_CACHE_DTYPES,
          f"k_cache and v_cache must both be int8 or both float8_e4m3fn, got {k_cache.dtype} "
          f"and {v_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(s.shape == k_cache.shape[:3], f"{name} must be {want}, got shape {tuple(s.shape)}")
        check(s.dtype == SCALE_DTYPE, f"{name} must be fp16 (as quantize_kv_per_head), got "
              f"{s.dtype}")
        check(s.device == k_cache.device, f"{name} must be on the caches' device "
              f"{k_cache.device}, got {s.device}")
    check(k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1,
          "k_scale and v_scale need the same strides and a contiguous last (head) dimension")
    return True


def scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple:
    """Kernel arguments (k_scale_ptr, v_scale_ptr, stride_sb, stride_ss, stride_sh); a float cache
    passes the cache itself as an unused pointer and zero strides."""
    if k_scale is None:
        return k_cache, k_cache, 0, 0, 0
    return k_scale, v_scale, *k_scale.stride()


def dequantize_cache(cache: torch.Tensor, scale: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch, for the kernels' references: the whole cache back to ``dtype`` (labkit's
    one INT8-KV dequantization, :func:`labkit.kv.ops.dequantize_kv_per_head`)."""
    return dequantize_kv_per_head(cache, scale, dtype)

