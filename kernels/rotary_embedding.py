"""Rotary position embedding applied in place to q and k (Llama's rotate-half convention).

For a head vector split in halves (x1, x2) and angles theta_i(pos) = pos * base^(-2i/D)::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin

The angles come from a ``cos_sin_cache [max_position, D]`` (cos in the first half, sin in the
second, fp32), built once by ``build_cos_sin_cache`` with the same formula as the model, so the
kernel only gathers one row per token. One program per token rotates all its q and k heads::

    token n, pos p ──► cos/sin row p ──► q[n, 0..Hq-1, :]  and  k[n, 0..Hkv-1, :]   (in place)

What bounds it: memory. 6 FLOPs per pair against 4 bytes read and written (bf16): < 1 FLOP/byte.
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


@triton.jit
def _rotate_heads(ptr, stride_h, cos, sin, num_heads, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    p1 = ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p1, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (b * cos[None, :] + a * sin[None, :]).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr, num_q_heads, num_kv_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_c,
    QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=dmask, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=dmask, other=0.0)
    _rotate_heads(q_ptr + n * stride_qn, stride_qh, cos, sin, num_q_heads, QH_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + n * stride_kn, stride_kh, cos, sin, num_kv_heads, KH_PAD, HALF,
                  HALF_PAD)


def build_cos_sin_cache(max_position: int, head_dim: int, base: float = 10000.0,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos(pos * inv_freq) | sin(pos * inv_freq)."""
    check(head_dim % 2 == 0, f"head_dim must be even for rotary embedding, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                .float() / head_dim))
    freqs = torch.outer(torch.arange(max_position, device=device).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [N, Hq, D] and k [N, Hkv, D] in place by their token positions [N].

    q and k may be strided views (e.g. of a fused qkv output) with a contiguous head_dim.
    Positions must index rows of ``cos_sin_cache`` (checked on CPU tensors).
    """
    check(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.numel(),
          f"q [N, Hq, D], k [N, Hkv, D] and positions [N] disagree: {tuple(q.shape)}, "
          f"{tuple(k.shape)}, {tuple(positions.shape)}")
    head_dim = q.shape[-1]
    check(k.shape[-1] == head_dim and cos_sin_cache.shape[-1] == head_dim,
          f"head_dim mismatch: q {head_dim}, k {k.shape[-1]}, cache {cos_sin_cache.shape[-1]}")
    check(head_dim % 2 == 0, f"head_dim must be even for rotary embedding, got {head_dim}")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.is_contiguous(),
          "q, k need a contiguous head_dim and the cos/sin cache must be contiguous")
    check(cos_sin_cache.dtype == torch.float32, "cos_sin_cache must be float32")
    check_dtype(q, "q", FLOAT_DTYPES)
    check_dtype(k, "k", FLOAT_DTYPES)
    check_dtype(positions, "positions", INDEX_DTYPES)
    check(len({t.device for t in (positions, q, k, cos_sin_cache)}) == 1,
          "positions, q, k and cos_sin_cache must be on one device")
    if q.shape[0] == 0:
        return
    positions = positions.reshape(-1).contiguous()  # the kernel reads entry n at offset n
    if on_host(positions):
        lo, hi = int(positions.min()), int(positions.max())
        check(lo >= 0 and hi < cos_sin_cache.shape[0], f"positions must be in [0, "
              f"{cos_sin_cache.shape[0]}) (the cos/sin cache's rows), got {lo}..{hi}")
    half = head_dim // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        QH_PAD=next_pow2(q.shape[1]), KH_PAD=next_pow2(k.shape[1]), HALF=half,
        HALF_PAD=next_pow2(half),
    )


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, fp32 math, Hugging Face's ``x * cos + rotate_half(x) * sin``."""
    half = q.shape[-1] // 2
    cos = cos_sin_cache[positions.long(), :half].repeat(1, 2)[:, None, :]
    sin = cos_sin_cache[positions.long(), half:].repeat(1, 2)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    return rot(q).to(q.dtype), rot(k).to(k.dtype)

