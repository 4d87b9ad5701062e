"""Paged attention for decode: one new query token per sequence reads its whole KV history.

The KV history is not contiguous: it lives in fixed-size physical blocks scattered in the cache
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables[b, i]`` names the physical
block holding tokens ``i*block_size .. (i+1)*block_size-1`` of sequence ``b``.

Tiling (one program per (sequence, kv head, split)); the G = Hq/Hkv query heads that share a kv
head ride along as the M rows of a small matrix product, padded to 16 for the tensor cores::

      q rows (G, padded to 16) x D          K tile: BLOCK_N tokens x D, gathered
      ┌──────────────┐                        through block_tables (token t lives in
      │ h0 h1 .. hG-1│  @  K^T  ──► S [16 x BLOCK_N] ──► online softmax ──► @ V ──► acc [16 x D]
      └──────────────┘        blocks: │phys 7│phys 2│phys 9│ ...   (logical order)

Online softmax keeps a running max ``m`` and sum ``l`` per row, so K and V are read exactly once.
With ``num_splits > 1`` ("flash-decoding") each sequence's context is cut into splits processed
by separate programs, each writing a partial (acc/l, log-sum-exp); a second small kernel merges
them. That keeps all SMs busy when batch x kv_heads is smaller than the GPU.

What bounds it: memory. Per token and kv head we read 2*D*bytes of K/V and do 4*G*D FLOPs, so
arithmetic intensity is 2*G/bytes = 4 FLOP/byte for G=4 in bf16, far below an H200's ~200
FLOP/byte ridge. The target is the copy bandwidth of the device.

INT8 KV cache (``k_scale``/``v_scale`` given): K/V tiles load as int8 codes plus one fp16 scale
per (token, kv head); the codes go into the dots as they are (exact in bf16) and the scales
multiply the score and probability tiles instead (``int8_kv.load_token_scales``). A (token, kv
head) then costs 2 * (D + 2) bytes of K+V instead of 2 * 2D in bf16: ~1.9x fewer bytes, hence
up to ~1.9x faster decode at long contexts. The cost: an int8 -> bf16 convert per element, two
multiplies per score (hidden under the memory stall) and the quantization error (half a step,
absmax / 254, per element). An FP8 (e4m3) cache is the same with e4m3 bytes, which
``fp8_kv.e4m3_to_fp16`` turns into fp16 with a shift and a mask (exact; see ``fp8_kv``).

Sliding window (``sliding_window=w``, a sliding layer of Mistral / Qwen2 / Gemma 3): the query at
position ``ctx_len - 1`` sees only keys ``ctx_len - w .. ctx_len - 1``, so every split starts its
loop at ``max(split start, ctx_len - w)``: tiles wholly before the window are never read, which
is what makes a sliding layer's decode cost O(w) instead of O(context).

Attention sinks (``sinks`` [Hq], gpt-oss): the softmax's denominator gains ``exp(sink_h)``, a term
with no value. The online softmax takes it as a first "key" of value 0: ``m = sink, l = 1,
acc = 0``, then the tiles as usual, so ``out = acc / (l_keys * 2^(m_keys - m) + 2^(sink - m))``
with ``m`` the max over keys and sink. With split-KV each split stays sink-free and the merge
adds ``2^(sink - m)`` to its denominator once (counting it per split would count it many times).
It costs one load per row: nothing per token.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from labkit.kernels._common import check, dot_precision, interpreting, next_pow2
from labkit.kernels.fp8_kv import kernel_view
from labkit.kernels.int8_kv import dequantize_cache, load_kv_tile, load_token_scales, scale_args
from labkit.kernels.paged_checks import (
    check_context_lens,
    check_paged_inputs,
    check_window,
    gather_kv,
    softmax_with_sinks,
)

LOG2E = 1.4426950408889634
LOG2E_JIT = tl.constexpr(LOG2E)  # the kernels work in base 2 (exp2)


@triton.jit
def _paged_decode_kernel(
    out_ptr, lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr,
    sm_scale_log2, tokens_per_split, window,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    QUERY_GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    KV_INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8  # compile-time: int8 cache
    KV_FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.uint8  # e4m3 bytes (fp8_kv)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx_len)
    if WINDOWED:  # keys before the window are never read (a split wholly before it is empty)
        start = tl.maximum(start, ctx_len - window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < QUERY_GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * QUERY_GROUP + offs_g

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink as a first "key" with value 0: m = sink, l = 2^0
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E_JIT
        l_i += 1.0
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_mask = offs_t < end
        phys = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        in_blk = offs_t % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = load_kv_tile(
            k_cache_ptr + (phys * stride_kb + in_blk * stride_ks + kv_head * stride_kh)[:, None]
            + offs_d[None, :], kv_mask, KV_INT8, KV_FP8, q.dtype,
        )
        v = load_kv_tile(
            v_cache_ptr + (phys * stride_vb + in_blk * stride_vs + kv_head * stride_vh)[:, None]
            + offs_d[None, :], kv_mask, KV_INT8, KV_FP8, q.dtype,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_INT8 or KV_FP8:  # S = (Q C_k^T) diag(k_scale): see int8_kv.load_token_scales
            s = s * load_token_scales(k_scale_ptr + kv_head * stride_sh, phys, in_blk, stride_sb,
                                      stride_ss, t_mask, KV_FP8)[None, :]
        s = s * sm_scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_INT8 or KV_FP8:  # P V = (P diag(v_scale)) C_v
            p = p * load_token_scales(v_scale_ptr + kv_head * stride_sh, phys, in_blk, stride_sb,
                                      stride_ss, t_mask, KV_FP8)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial result of this split, normalised, plus its log2-sum-exp for the merge.
        # An empty split (start >= ctx_len) writes 0 and -inf, which the merge weighs as 0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os
            + offs_d[None, :], o, mask=out_mask,
        )
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    else:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=out_mask,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_ptr, lse_ptr, sinks_ptr, num_splits,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out = sum_s w_s * part_s / (sum_s w_s + w_sink) with w_s = 2^(lse_s - m), m the largest
    lse (and sink): the sink joins the denominator here, once, not in every split."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_JIT
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    w = tl.where(s_mask & (lse > float("-inf")), w, 0.0)
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    part = tl.load(
        part_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
        + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / den
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                       block_n: int = 64, num_sms: int | None = None) -> int:
    """Enough splits that (seqs x kv heads x splits) covers the GPU about twice, and each split
    still has at least 4 tiles of work; 1 when the batch alone fills the device."""
    if num_sms is None:
        num_sms = (torch.cuda.get_device_properties(0).multi_processor_count
                   if torch.cuda.is_available() else 8)
    programs = num_seqs * num_kv_heads
    want = math.ceil(2 * num_sms / max(programs, 1))
    most = max(1, max_context // (4 * block_n))
    return max(1, min(want, most, 64))


def paged_attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
    block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache. q [B, Hq, D] -> out [B, Hq, D] (q's dtype).

    ``num_splits=None`` picks split-KV automatically (see ``default_num_splits``); 1 forces the
    single-pass kernel. Every context_lens entry must be >= 1 and fit its block-table row
    (checked on CPU tensors; on a GPU the caller guarantees it). INT8 cache: int8 caches plus
    fp16 ``k_scale``/``v_scale`` [num_blocks, block_size, Hkv] (``int8_kv``); FP8 the same with
    float8_e4m3fn caches (``fp8_kv``). ``sliding_window``: each query sees only its last that
    many keys (None: all of them). ``sinks`` [Hq]: gpt-oss's sink logits, one more term in each
    head's softmax denominator (``labkit.model.sinks``).
    """
    _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale,
                         sliding_window, sinks)
    # the kernel indexes a table row and the lengths with unit stride
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_n, num_splits, tokens_per_split = _decode_tiling(q, k_cache, block_tables, block_n,
                                                           num_splits)
    out = torch.empty_like(q)
    split = num_splits > 1
    o, lse, strides_o, strides_l = _split_outputs(out, num_splits)
    sinks_arg = q if sinks is None else sinks.contiguous()
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        o, lse, q, kernel_view(k_cache), kernel_view(v_cache), block_tables, context_lens,
        *scale_args(k_cache, k_scale, v_scale)[:2], sinks_arg,
        scale * LOG2E, tokens_per_split, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_args(k_cache, k_scale, v_scale)[2:],
        block_tables.stride(0), *strides_o, *strides_l,
        QUERY_GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        DOT_FP32=interpreting(), PRECISION=dot_precision(q.dtype),
        WINDOWED=sliding_window is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_splits(out, o, lse, sinks_arg, num_splits, sinks is not None)
    return out


def _check_decode_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    sliding_window: int | None, sinks: torch.Tensor | None,
) -> None:
    """One query token per sequence and every context non-empty and within its table row: the
    kernel trusts both (on a GPU the caller guarantees the lengths)."""
    check_window(sliding_window)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks)
    check(q.dim() == 3, f"q must be [num_seqs, num_q_heads, head_dim], got {tuple(q.shape)}")
    check(q.shape[0] == block_tables.shape[0], "q and block_tables disagree on num_seqs")
    check_context_lens(block_tables, context_lens, k_cache, min_len=1)


def _decode_tiling(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   block_n: int | None, num_splits: int | None) -> tuple[int, int, int]:
    """(BLOCK_N, num_splits, tokens_per_split): each split a whole number of BLOCK_N tiles,
    and as many splits as that leaves non-empty (so the merge never reads an unwritten one)."""
    num_seqs, _, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_n is None:  # tokens are gathered one by one, so any power of two works
        block_n = max(next_pow2(block_size), 64 if head_dim <= 128 else 32)
    check(block_n >= 16 and block_n == next_pow2(block_n),
          f"block_n must be a power of two >= 16, got {block_n}")
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
                   if q.is_cuda else None)
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context, block_n, num_sms)
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, tokens_per_split) if max_context else 1
    return block_n, num_splits, tokens_per_split


def _split_outputs(out: torch.Tensor, num_splits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Where the decode kernel writes: with one split straight into ``out`` (no log-sum-exp);
    with more, fp32 partial outputs and log-sum-exps per split for the merge kernel.
    Returns (o, lse, o's strides, lse's strides)."""
    if num_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0), (0, 0)  # lse unused
    num_seqs, num_q_heads, head_dim = out.shape
    part = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                       device=out.device)
    lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    return part, lse, (part.stride(0), part.stride(1), part.stride(2)), (lse.stride(0),
                                                                          lse.stride(1))


def _merge_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor,
                  sinks_arg: torch.Tensor, num_splits: int, has_sinks: bool) -> None:
    """Launch the merge: one program per (sequence, q head) combines the splits into ``out``."""
    num_seqs, num_q_heads, head_dim = out.shape
    _merge_splits_kernel[(num_seqs, num_q_heads)](
        out, part, lse, sinks_arg, num_splits,
        out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        SPLITS_PAD=max(2, next_pow2(num_splits)), HAS_SINKS=has_sinks,
    )


def paged_attention_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's K/V, softmax(q K^T * scale) V in fp32 (an INT8/FP8
    cache is dequantized to q's dtype first); a window keeps only the last keys; sinks join
    the softmax as one more column whose probability is dropped."""
    k_cache = dequantize_cache(k_cache, k_scale, q.dtype)
    v_cache = dequantize_cache(v_cache, v_scale, q.dtype)
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        lo = 0 if sliding_window is None else max(0, n - sliding_window)
        k = gather_kv(k_cache, block_tables[b], n)[lo:].float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[b], n)[lo:].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", softmax_with_sinks(scores, sinks), v).to(q.dtype)
    return out
