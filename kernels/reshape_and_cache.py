"""reshape_and_cache: write the new tokens' K and V into their slots of the paged cache.

``slot_mapping[n] = physical_block * block_size + offset`` says where token n goes; -1 means a
padding token that must not be written. One program per token copies its [Hkv, D] key and value
rows (``Hkv*D`` contiguous elements each in the cache)::

    key [N, Hkv, D]                 k_cache [num_blocks, block_size, Hkv, D]
    token n ──── slot 37 ─────────► block 37 // 16 = 2, row 37 % 16 = 5

What bounds it: memory, pure copy (0 FLOPs): 2 * N * Hkv * D * bytes read and as many written.

INT8 or FP8 KV cache (``k_scale``/``v_scale`` given, caches int8 or float8_e4m3fn): each token's
[Hkv, D] rows are quantized in registers, one absmax scale per (token, head), exactly as
``labkit.kv.ops.quantize_kv_per_head`` (same codes and fp16 scales, bit for bit; see
``int8_kv.quantize_rows`` and ``fp8_kv.quantize_rows_fp8``, which packs e4m3's bits by hand).
It writes D + 2 bytes per (token, head) instead of 2 * D (bf16) and adds a row max and a divide
per element, which a copy-bound kernel hides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from labkit.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_dtype,
    next_pow2,
    on_host,
)
from labkit.kernels.fp8_kv import is_fp8, kernel_view, quantize_rows_fp8
from labkit.kernels.int8_kv import check_kv_scales, quantize_rows, scale_args

from labkit.kv.ops import quantize_kv_per_head


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    stride_sb, stride_ss, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    KV_INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8  # compile-time: int8 cache
    KV_FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.uint8  # e4m3 bytes (fp8_kv)
    n = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    n64 = n.to(tl.int64)
    k = tl.load(key_ptr + n64 * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(value_ptr + n64 * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    if KV_INT8 or KV_FP8:  # codes into the caches, one fp16 scale per (token, head) beside them
        if KV_INT8:
            k, k_s = quantize_rows(tl.where(mask, k, 0.0))
            v, v_s = quantize_rows(tl.where(mask, v, 0.0))
        else:
            k, k_s = quantize_rows_fp8(tl.where(mask, k, 0.0))
            v, v_s = quantize_rows_fp8(tl.where(mask, v, 0.0))
        s_off = blk * stride_sb + off * stride_ss + offs_h * stride_sh
        tl.store(k_scale_ptr + s_off, k_s, mask=offs_h < NUM_HEADS)
        tl.store(v_scale_ptr + s_off, v_s, mask=offs_h < NUM_HEADS)
    tl.store(k_cache_ptr + blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch
             + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch
             + offs_d[None, :], v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Scatter key/value [N, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D].

    ``slot_mapping`` [N] int32/int64: a slot in ``[0, num_blocks * block_size)`` or -1 (skip);
    checked on CPU tensors (where a wrong slot would write outside the cache), on a GPU the
    caller guarantees it. INT8 (FP8) cache: int8 (float8_e4m3fn) caches plus fp16
    ``k_scale``/``v_scale`` [num_blocks, block_size, Hkv] that receive each written (token,
    head)'s scale.
    """
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    n, heads, dim = key.shape
    if n == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # the kernel reads entry n at offset n
    if on_host(slot_mapping):
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        check(lo >= -1 and hi < num_slots, f"slot_mapping entries must be -1 (padding) or a "
              f"slot in [0, {num_slots}), got min {lo}, max {hi}")
    _reshape_and_cache_kernel[(n,)](
        key, value, kernel_view(k_cache), kernel_view(v_cache), slot_mapping,
        *scale_args(k_cache, k_scale, v_scale)[:2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_args(k_cache, k_scale, v_scale)[2:],
        NUM_HEADS=heads, HEAD_DIM=dim, HEADS_PAD=next_pow2(heads), DIM_PAD=next_pow2(dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def _check_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> None:
    """Shapes, dtypes, strides and devices the kernel's pointer arithmetic assumes: a mismatch
    would scatter garbage silently, so it is a named error here."""
    check(key.dim() == 3 and key.shape == value.shape,
          f"key and value must both be [N, num_kv_heads, head_dim], got {tuple(key.shape)} "
          f"and {tuple(value.shape)}")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape
          and k_cache.shape[2:] == key.shape[1:],
          f"caches {tuple(k_cache.shape)} do not match key rows {tuple(key.shape[1:])}")
    check(slot_mapping.dim() == 1 and slot_mapping.numel() == key.shape[0],
          f"slot_mapping must have one entry per token ({key.shape[0]}), "
          f"got {tuple(slot_mapping.shape)}")
    if check_kv_scales(k_cache, v_cache, k_scale, v_scale):
        kind = "an fp8" if is_fp8(k_cache) else "an int8"
        check_dtype(key, f"key (quantized into {kind} cache)", FLOAT_DTYPES)
        check(value.dtype == key.dtype, f"key and value dtypes differ: {key.dtype}, "
              f"{value.dtype}")
    else:
        check(key.dtype == k_cache.dtype and value.dtype == v_cache.dtype,
              f"key dtype {key.dtype} != cache dtype {k_cache.dtype}")
    check(key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
          and v_cache.stride(-1) == 1, "head_dim must be the contiguous dimension")
    check_dtype(slot_mapping, "slot_mapping", INDEX_DTYPES)
    check(len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) == 1,
          "key, value, the caches and slot_mapping must be on one device")


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
    """Plain PyTorch: index_copy into the flattened [num_blocks*block_size, Hkv, D] view; with
    scales, ``labkit.kv.ops.quantize_kv_per_head`` (into the cache's code dtype) first. FP8
    codes are copied as bytes (CPU torch has no float8 index_put)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is not None:
        key, ks = quantize_kv_per_head(key, k_cache.dtype)
        value, vs = quantize_kv_per_head(value, v_cache.dtype)
        k_scale.view(-1, k_scale.shape[2])[slots] = ks[keep]
        v_scale.view(-1, v_scale.shape[2])[slots] = vs[keep]
    if is_fp8(k_cache):
        k_cache, v_cache = kernel_view(k_cache), kernel_view(v_cache)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]
