"""Paged prefill attention: a chunk of new query tokens per sequence over its cached blocks.

Serves a first prefill, a chunked prefill (the chunk attends to the earlier chunks already in the
cache) and a prefix-cache hit (the shared prefix's blocks are already there). Sequences of
different lengths go in one launch: their new tokens are packed back to back in ``q [N, Hq, D]``
and ``query_start_loc[b] .. query_start_loc[b+1]`` are sequence b's rows. Sequence b's new tokens
sit at positions ``context_lens[b] - q_len .. context_lens[b] - 1`` and each attends to keys at
positions <= its own. Their K/V were written to the cache (reshape_and_cache) before this runs.

Tiling (one program per (query tile, sequence, query head))::

                     keys, by position, gathered through block_tables
                 0 ................ prefix ......... ctx_len
    query tile ┌──────────────────────────┬──────────┐
    BLOCK_M    │  all visible             │ causal ◣ │   S = Q K^T tile by tile (BLOCK_N keys),
    rows       └──────────────────────────┴──────────┘   online softmax, acc += P V

The key loop stops at the tile's last query position, so the upper triangle is never read.

What bounds it: compute for long chunks. Each K/V tile loaded once is used by BLOCK_M query rows:
intensity ~ BLOCK_M * 4 * D / (2 * D * bytes) = BLOCK_M FLOP/byte in bf16 (64 for BLOCK_M=64),
so with BLOCK_M >= 64 it leans towards the tensor cores' limit; short chunks are memory-bound.

INT8 KV cache (``k_scale``/``v_scale`` given): tiles load as int8 codes plus one fp16 scale per
(token, kv head); the codes enter the dots as they are and the scales multiply the score and
probability tiles (``int8_kv.load_token_scales``): D + 2 bytes per (token, kv head) for K (and
for V) instead of 2 * D in bf16. That matters for the memory-bound short chunks and long cached
prefixes; long chunks are compute-bound, where the extra convert per element is the cost and
the bytes saved buy little.

Sliding window (``sliding_window=w``): query position p sees keys ``p - w + 1 .. p``. The key
loop then starts at the tile's first query position minus ``w - 1`` (nothing before it is read)
and every tile is masked, since rows of one tile see different windows; a row can meet a tile
with no key it sees, so the online softmax guards its max against -inf.

FP8 (e4m3) caches: as INT8, the bytes decoded by ``fp8_kv.e4m3_to_fp16``. Attention sinks
(``sinks`` [Hq], gpt-oss): each row's online softmax starts at ``m = sink, l = 1`` (the sink as a
key of value 0, see ``paged_attention``), so a row's max is finite from the start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from labkit.kernels._common import (
    INDEX_DTYPES,
    check,
    check_dtype,
    dot_precision,
    interpreting,
    next_pow2,
    on_host,
)
from labkit.kernels.fp8_kv import kernel_view
from labkit.kernels.int8_kv import dequantize_cache, load_kv_tile, load_token_scales, scale_args
from labkit.kernels.paged_attention import LOG2E, LOG2E_JIT
from labkit.kernels.paged_checks import (
    check_context_lens,
    check_paged_inputs,
    check_window,
    gather_kv,
    softmax_with_sinks,
)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, t0, kv_end, bt_row, k_base, v_base, ks_base, vs_base,
                 stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, sm_scale_log2,
                 offs_d, d_mask, window,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, KV_INT8: tl.constexpr,
                 KV_FP8: tl.constexpr, WINDOWED: tl.constexpr):
    """One BLOCK_N tile of keys: gather through the block table, online-softmax update."""
    offs_t = t0 + tl.arange(0, BLOCK_N)
    t_mask = offs_t < kv_end
    phys = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    in_blk = offs_t % BLOCK_SIZE
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = load_kv_tile(k_base + (phys * stride_kb + in_blk * stride_ks)[:, None] + offs_d[None, :],
                     kv_mask, KV_INT8, KV_FP8, q.dtype)
    v = load_kv_tile(v_base + (phys * stride_vb + in_blk * stride_vs)[:, None] + offs_d[None, :],
                     kv_mask, KV_INT8, KV_FP8, q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if KV_INT8 or KV_FP8:  # S = (Q C_k^T) diag(k_scale): see int8_kv.load_token_scales
        s = s * load_token_scales(ks_base, phys, in_blk, stride_sb, stride_ss, t_mask,
                                  KV_FP8)[None, :]
    s = s * sm_scale_log2
    if MASKED:
        visible = (offs_t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if WINDOWED:
            visible = visible & (offs_t[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # Without a window every row sees key 0 (in the first tile), so m_new is finite from then
    # on; with one, a row may see nothing yet: use 0 as its max so exp2 gives 0, never NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if WINDOWED else m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_INT8 or KV_FP8:  # P V = (P diag(v_scale)) C_v
        p = p * load_token_scales(vs_base, phys, in_blk, stride_sb, stride_ss, t_mask,
                                  KV_FP8)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    context_lens_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, sm_scale_log2, window,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    KV_INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8  # compile-time: int8 cache
    KV_FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.uint8  # e4m3 bytes (fp8_kv)
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // QUERY_GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix = ctx_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink as a first "key" with value 0: m = sink, l = 2^0 (see the top)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_JIT
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    ks_base = k_scale_ptr + kv_head * stride_sh
    vs_base = v_scale_ptr + kv_head * stride_sh
    # Keys before the tile's first query position are visible to every row: no mask there.
    full_end = ((prefix + tile * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(ctx_len, prefix + (tile + 1) * BLOCK_M)
    lo = 0
    if WINDOWED:  # start at the first row's window; every tile masked (rows' windows differ)
        lo = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
        full_end = lo
    for t0 in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, t0, kv_end, bt_row, k_base, v_base,
                                     ks_base, vs_base, stride_kb, stride_ks, stride_vb, stride_vs,
                                     stride_sb, stride_ss, sm_scale_log2, offs_d, d_mask,
                                     window, BLOCK_SIZE, BLOCK_N, False, DOT_FP32, PRECISION,
                                     KV_INT8, KV_FP8, WINDOWED)
    for t0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, t0, kv_end, bt_row, k_base, v_base,
                                     ks_base, vs_base, stride_kb, stride_ks, stride_vb, stride_vs,
                                     stride_sb, stride_ss, sm_scale_log2, offs_d, d_mask,
                                     window, BLOCK_SIZE, BLOCK_N, True, DOT_FP32, PRECISION,
                                     KV_INT8, KV_FP8, WINDOWED)

    if WINDOWED:  # a padded row past the chunk may have seen no key at all: keep it finite
        l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_query_len: int | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of packed new tokens q [N, Hq, D] over the paged cache.

    ``max_query_len`` sizes the grid; when omitted it is read from query_start_loc (one host
    sync). Returns [N, Hq, D] in q's dtype. query_start_loc must run from 0 to N without going
    down, and each q_len must be <= its context_lens entry, which must fit its block-table row
    (all checked on CPU tensors; on a GPU the caller guarantees them). INT8 cache: int8 caches
    plus fp16 ``k_scale``/``v_scale`` [num_blocks, block_size, Hkv] (``int8_kv``); FP8 the same
    with float8_e4m3fn caches (``fp8_kv``). ``sliding_window``: query position p sees keys
    p - window + 1 .. p (None: 0 .. p). ``sinks`` [Hq]: gpt-oss's per-head sink logits.
    """
    _check_prefill_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                          max_query_len, k_scale, v_scale, sinks, sliding_window)
    num_seqs = block_tables.shape[0]
    _, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    query_start_loc, context_lens = query_start_loc.contiguous(), context_lens.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    out = torch.empty_like(q)
    if max_query_len == 0 or q.shape[0] == 0:
        return out
    block_m, block_n, num_warps = _prefill_tiles(max_query_len, block_m, block_n, num_warps)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_q_heads)
    _paged_prefill_kernel[grid](
        out, q, kernel_view(k_cache), kernel_view(v_cache), block_tables, query_start_loc,
        context_lens, *scale_args(k_cache, k_scale, v_scale)[:2],
        q if sinks is None else sinks.contiguous(), scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_args(k_cache, k_scale, v_scale)[2:],
        block_tables.stride(0),
        QUERY_GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_pow2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=interpreting(), PRECISION=dot_precision(q.dtype),
        WINDOWED=sliding_window is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _check_prefill_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, max_query_len: int | None,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, sinks: torch.Tensor | None,
    sliding_window: int | None,
) -> None:
    """Shapes, dtypes and devices always; on CPU tensors also the packed layout itself
    (query_start_loc rising from 0 to N, each q_len within its context and max_query_len),
    since a wrong value there would read or write outside the tensors."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks)
    check_window(sliding_window)
    check(q.dim() == 3, f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    num_seqs = block_tables.shape[0]
    check(query_start_loc.dim() == 1 and query_start_loc.numel() == num_seqs + 1,
          f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
          f"got {query_start_loc.numel()}")
    check_dtype(query_start_loc, "query_start_loc", INDEX_DTYPES)
    check(query_start_loc.device == q.device, "query_start_loc must be on q's device")
    check_context_lens(block_tables, context_lens, k_cache, min_len=0)
    if on_host(query_start_loc, context_lens) and num_seqs:
        q_lens = query_start_loc[1:].long() - query_start_loc[:-1].long()
        check(int(query_start_loc[0]) == 0 and int(query_start_loc[-1]) == q.shape[0]
              and bool((q_lens >= 0).all()),
              f"query_start_loc must rise from 0 to num_tokens = {q.shape[0]}, got "
              f"{query_start_loc.tolist()}")
        check(bool((q_lens <= context_lens.long()).all()),
              f"each sequence's new tokens (q_lens {q_lens.tolist()}) must be <= its "
              f"context_lens {context_lens.tolist()} (they are part of the context)")
        check(max_query_len is None or max_query_len >= int(q_lens.max()),
              f"max_query_len {max_query_len} < the longest q_len {int(q_lens.max())}")


def _prefill_tiles(max_query_len: int, block_m: int | None, block_n: int | None,
                   num_warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a 16-row query tile when every sequence's new tokens fit
    it (chunked decode-like steps), 64 rows otherwise; the warps follow the tile."""
    if block_m is None:
        block_m = 16 if max_query_len <= 16 else 64
    if block_n is None:
        block_n = 64
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        check(val >= 16 and val == next_pow2(val), f"{name} must be a power of two >= 16, "
              f"got {val}")
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    return block_m, block_n, num_warps


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch, one sequence at a time, fp32, explicit causal (and window) mask by
    position (an INT8/FP8 cache is dequantized to q's dtype first), sinks as an extra column."""
    k_cache = dequantize_cache(k_cache, k_scale, q.dtype)
    v_cache = dequantize_cache(v_cache, v_scale, q.dtype)
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(block_tables.shape[0]):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n = int(context_lens[b])
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (e - s), n, device=q.device)
        scores = torch.einsum("qhd,thd->hqt", q[s:e].float(), k) * scale
        kpos = torch.arange(n, device=q.device)[None, :]
        mask = kpos <= q_pos[:, None]
        if sliding_window is not None:
            mask &= kpos > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = torch.einsum("hqt,thd->qhd", softmax_with_sinks(scores, sinks), v).to(q.dtype)
    return out
