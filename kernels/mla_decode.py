"""Absorbed MLA decode (DeepSeek-V3's latent attention) over the paged latent cache, in Triton.

The cache of a latent layer is ``[num_blocks, block_size, 1, C + R]``: per token the latent
``c`` (C = kv_lora_rank = 512 in V3) and the rotary key ``k_pe`` (R = 64). With ``W_UK``
absorbed into the query (``q_lat = W_UK^T q_nope``, a dense matmul done outside) every head
scores the *same* latent rows, so one program takes all heads of a sequence (a block of up to
``BLOCK_H``) as the M rows of its dots, the way FlashMLA does::

      q_lat rows (heads) x C    +   q_pe rows x R        latent tile: BLOCK_N tokens x (C + R),
      ┌───────────────┐             ┌──────┐             gathered through block_tables
      │ h0 .. hH-1    │ @ c^T   +   │      │ @ k_pe^T ──► S [H x BLOCK_N] ──► online softmax
      └───────────────┘             └──────┘                            ──► P @ c ──► o_lat [H x C]

and writes ``o_lat = sum_s p_s c_s`` [B, H, C]; ``W_UV`` is applied after (outside), once per
head. What bounds it: each cached token costs (C + R) x bytes, read once for all H heads,
against 4 x H x (C + R) FLOPs: an arithmetic intensity of ~2H/bytes = 128 FLOP/byte for V3's
128 heads in bf16, 32x MHA decode's 4; absorbed MLA decode sits near the ridge of an H200
instead of far below it. (Why the cache is 576 values per token and why decode absorbs:
:mod:`labkit.model.mla`.)

Reference: :func:`labkit.kv.mla.mla_decode_absorbed`, which this module's
:func:`mla_decode_triton` replaces with the same signature (the Triton backend's
``mla_decode``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from labkit.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_dtype,
    dot_precision,
    interpreting,
    next_pow2,
    on_host,
)

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    out_ptr, q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, sm_scale_log2,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs, stride_bt,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, RANK_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    h_mask, c_mask, r_mask = heads < NUM_HEADS, offs_c < RANK, offs_r < ROPE
    q = tl.load(q_lat_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
                mask=h_mask[:, None] & c_mask[None, :], other=0.0)
    qp = tl.load(q_pe_ptr + seq * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                 mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if DOT_FP32:
        q, qp = q.to(tl.float32), qp.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    ctx_len = tl.load(context_lens_ptr + seq)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(0, ctx_len, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_mask = offs_t < ctx_len
        phys = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = cache_ptr + phys * stride_cb + (offs_t % BLOCK_SIZE) * stride_cs
        c = tl.load(row[:, None] + offs_c[None, :], mask=t_mask[:, None] & c_mask[None, :],
                    other=0.0)
        kp = tl.load(row[:, None] + RANK + offs_r[None, :],
                     mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        if DOT_FP32:
            c, kp = c.to(tl.float32), kp.to(tl.float32)
        s = tl.dot(q, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
        s = tl.where(t_mask[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


def _check(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """ValueError for inputs the kernel would misread (raw pointers)."""
    check(q_lat.dim() == 3 and q_pe.dim() == 3 and q_lat.shape[:2] == q_pe.shape[:2],
          f"q_lat [B, H, C] and q_pe [B, H, R] must agree on B and H, got "
          f"{tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    B, _, C = q_lat.shape
    check(cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == C + q_pe.shape[2],
          f"cache must be [num_blocks, block_size, 1, C + R] = [.., .., 1, {C + q_pe.shape[2]}]"
          f", got {tuple(cache.shape)}")
    check(cache.stride(3) == 1 and q_lat.stride(2) == 1 and q_pe.stride(2) == 1,
          "the last dimension of cache, q_lat and q_pe must be contiguous")
    check(block_tables.dim() == 2 and block_tables.shape[0] == B and context_lens.shape == (B,),
          f"block_tables must be [{B}, max_blocks] and context_lens [{B}]")
    for t, n in ((q_lat, "q_lat"), (q_pe, "q_pe"), (cache, "cache")):
        check_dtype(t, n, FLOAT_DTYPES)
    check_dtype(block_tables, "block_tables", INDEX_DTYPES)
    check_dtype(context_lens, "context_lens", INDEX_DTYPES)
    if on_host(block_tables, context_lens):
        lens = context_lens.tolist()
        check(all(1 <= n <= block_tables.shape[1] * cache.shape[1] for n in lens),
              f"every context length must be in 1..{block_tables.shape[1] * cache.shape[1]} "
              f"(the block tables' reach), got {lens}")


def mla_decode_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """The paged part: absorbed queries q_lat [B,H,C], q_pe [B,H,R] over the latent cache ->
    o_lat [B,H,C] (float32): the attention-weighted latent per head, before ``W_UV``."""
    _check(q_lat, q_pe, cache, block_tables, context_lens)
    B, H, C = q_lat.shape
    R = q_pe.shape[2]
    out = torch.empty(B, H, C, dtype=torch.float32, device=q_lat.device)
    block_h = min(64, max(16, next_pow2(H)))
    rank_pad = max(16, next_pow2(C))
    dot32 = interpreting() or cache.dtype == torch.float32
    # the [BLOCK_H, C] float32 accumulator lives in registers: 8 warps from 64 x 256 up (V3's
    # 64 x 512 is 128 KB); both configurations compile for sm_90 (tests/kernels/compile_sm90.py)
    warps = 8 if block_h * rank_pad >= 64 * 256 else 4
    _mla_decode_kernel[(B, math.ceil(H / block_h))](
        out, q_lat, q_pe, cache, block_tables, context_lens, scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=H, BLOCK_H=block_h, RANK=C, RANK_PAD=rank_pad, ROPE=R,
        ROPE_PAD=max(16, next_pow2(R)), BLOCK_SIZE=cache.shape[1],
        BLOCK_N=max(16, min(64, next_pow2(cache.shape[1]))), DOT_FP32=dot32,
        PRECISION=dot_precision(torch.float32 if dot32 else cache.dtype), num_warps=warps,
    )
    return out


def mla_decode_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`labkit.kv.mla.mla_decode_absorbed` with the paged part in Triton: ``W_UK``
    absorbed into the query and ``W_UV`` applied after as dense matmuls. Returns [B,H,dv]."""
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(cache.dtype).contiguous()
    o_lat = mla_decode_latent(q_lat, q_pe.to(cache.dtype).contiguous(), cache, block_tables,
                              context_lens, scale)
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv.float()).to(q_nope.dtype)
