"""Fused mixture-of-experts MLP: every expert's SwiGLU for a batch in two grouped GEMMs.

A MoE layer sends each token to ``k`` of ``E`` experts. The naive loop (``fused_moe_ref``) runs
one small matmul per expert: E launches per layer, most of them tiny, and an expert with few
tokens reads its whole weight for a handful of rows. vLLM's ``fused_moe`` instead sorts the
(token, k) pairs by expert once and runs ONE launch over all experts: each program owns a block
of ``BLOCK_M`` sorted rows that all belong to the same expert, so it multiplies them by that
expert's weight tile like an ordinary GEMM (tensor cores, fp32 accumulation)::

    topk_ids [T, k] ─► moe_align_block_size ─► sorted_token_ids  [p p p P | p P P P | p p p p | ..]
                                               expert_ids        [  e0    |   e2    |   e5    | ..]
                       (P = pad entry T*k: masked)     one BLOCK_M block = one expert

    pass 1, per block:  h[pair] = SiLU(x[tok] @ W_gate[e].T) * (x[tok] @ W_up[e].T)   [T*k, I]
    pass 2, per block:  o[pair] = topk_weight[pair] * (h[pair] @ W_down[e].T)          [T*k, H]
    out[t] = sum over its k pairs of o                                                 [T, H]

Both passes are the same kernel (``_grouped_gemm_kernel``) with constexpr flags: pass 1 reads
row ``pair // k`` of the hidden states (each token once per chosen expert, never copied) and
keeps two accumulators, gate and up, so SiLU(gate) * up happens in registers and only the
product is written; pass 2 reads row ``pair`` of h and multiplies the routing weight in before
the store. The top-k sum is a reduction over k in PyTorch (a tiny, memory-bound pass, as vLLM's
``moe_sum``); o is kept in fp32 so the output is rounded to the model dtype once.

What bounds it: an expert's weight tile is read once per block of its rows, so the arithmetic
intensity per expert is ~BLOCK_M-ish FLOPs per weight byte when it has many tokens; in decode
(T*k rows spread over E experts, ~T*k/E rows each) it is weight-bandwidth bound like a dense
GEMV, but over only the experts actually chosen. Padding costs at most BLOCK_M - 1 wasted rows
per non-empty expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from labkit.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_dtype,
    dot_precision,
    interpreting,
    on_host,
)


def max_padded_rows(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Upper bound on ``num_tokens_post_padded``: each non-empty expert (at most
    min(E, T*k) of them) wastes at most ``block_size - 1`` pad rows. A static bound sizes the
    buffers without reading the routing back to the host (no device sync per layer)."""
    return num_pairs + min(num_experts, num_pairs) * (block_size - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, k) pairs by expert and pad each expert's run to ``block_size``.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:
    - ``sorted_token_ids`` [max_padded_rows] int64: pair indices ``t * k + j``, grouped by
      expert (ascending), pairs of one expert in their original order; every expert's run padded
      to a multiple of ``block_size`` with ``T * k`` (an index no pair has), and the tail beyond
      ``num_tokens_post_padded`` filled with it too;
    - ``expert_ids`` [max_padded_rows / block_size] int64: the expert of each block, -1 for the
      blocks past ``num_tokens_post_padded``;
    - ``num_tokens_post_padded`` [1] int64: the rows in use (a multiple of ``block_size``).

    Plain PyTorch, not a kernel: this is index bookkeeping over T*k integers (a bincount, a
    stable sort, a scatter), negligible next to the GEMMs' FLOPs; vLLM writes it in CUDA to
    save launches. Every step stays on the device: no ``.item()``, so no sync per layer.
    """
    check(topk_ids.dim() == 2, f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    check_dtype(topk_ids, "topk_ids", INDEX_DTYPES)
    check(block_size >= 1 and num_experts >= 1,
          f"block_size and num_experts must be >= 1, got {block_size} and {num_experts}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    if on_host(topk_ids) and n:
        lo, hi = int(flat.min()), int(flat.max())
        check(lo >= 0 and hi < num_experts,
              f"topk_ids must name experts in [0, {num_experts}), got {lo}..{hi}")
    # scatter_add, not bincount: bincount sizes its output from max(flat), a sync on a GPU
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    by_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # rank of each pair inside its expert
    rank = torch.arange(n, device=dev) - first_of_expert[by_expert]
    rows = max_padded_rows(n, num_experts, block_size)
    sorted_ids = torch.full((rows,), n, dtype=torch.long, device=dev)
    sorted_ids[seg_start[by_expert] + rank] = order
    blocks = (rows + block_size - 1) // block_size
    block_start = torch.arange(blocks, device=dev) * block_size
    expert_ids = torch.searchsorted(seg_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids, expert_ids, seg_end[-1:].clone()


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, ntpp_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """c[pair, n] = (a[pair // TOP_K] @ w[e].T)[n] for the BLOCK_M sorted pairs of program
    (m, n), all of expert e. GATED: w[e] holds gate rows [0, N) then up rows [N, 2N) and
    c = SiLU(gate) * up. MUL_ROUTED_WEIGHT: c *= topk_weights[pair]."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return  # past the last expert's padded run: the static grid's spare programs
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs  # pad entries (== num_pairs) compute nothing and store nothing
    a_rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_offs = offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [BK, BN]: w[e].T
        w = tl.load(w_base + w_offs, mask=w_mask, other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong (see _common.interpreting)
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_base + N * stride_wn + w_offs, mask=w_mask, other=0.0)
            if DOT_FP32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if GATED:  # SiLU(gate) * up in fp32 registers: h never exists unfused in memory
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_offs = pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def default_config(num_pairs: int, num_experts: int) -> dict[str, int]:
    """Tiles by rows per expert: decode (few rows each) wastes less padding with BLOCK_M = 16;
    prefill fills 64-row blocks and reuses each weight tile 4x more."""
    if num_pairs <= 4 * num_experts:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}


def _grouped_gemm(a, w, c, topk_weights, align, n, k, top_k, gated, mul_weight, cfg):
    sorted_ids, expert_ids, ntpp = align
    grid = (expert_ids.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, ntpp,
        n, k, topk_weights.numel(), a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        c.stride(0),
        TOP_K=top_k, GATED=gated, MUL_ROUTED_WEIGHT=mul_weight, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DOT_FP32=interpreting(),
        PRECISION=dot_precision(a.dtype), num_warps=cfg["num_warps"],
    )


def _check_moe_args(hidden, w13, w2, topk_weights, topk_ids) -> None:
    check(hidden.dim() == 2, f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    check_dtype(hidden, "hidden", FLOAT_DTYPES)
    t, h = hidden.shape
    check(w13.dim() == 3 and w13.shape[1] % 2 == 0 and w13.shape[2] == h,
          f"w13 must be [E, 2*I, H={h}] (gate rows then up rows), got {tuple(w13.shape)}")
    e, i = w13.shape[0], w13.shape[1] // 2
    check(w2.shape == (e, h, i), f"w2 must be [E={e}, H={h}, I={i}], got {tuple(w2.shape)}")
    check(w13.dtype == hidden.dtype and w2.dtype == hidden.dtype,
          f"w13 and w2 must have hidden's dtype {hidden.dtype}, got {w13.dtype} and {w2.dtype}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == t and topk_ids.shape[1] >= 1,
          f"topk_ids must be [T={t}, k], got {tuple(topk_ids.shape)}")
    check(topk_weights.shape == topk_ids.shape,
          f"topk_weights must be shaped like topk_ids {tuple(topk_ids.shape)}, "
          f"got {tuple(topk_weights.shape)}")
    check_dtype(topk_weights, "topk_weights", FLOAT_DTYPES)
    check_dtype(topk_ids, "topk_ids", INDEX_DTYPES)
    if on_host(topk_ids) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        check(lo >= 0 and hi < e, f"topk_ids must name experts in [0, {e}), got {lo}..{hi}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: dict[str, int] | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), every expert a
    SwiGLU MLP: ``down(SiLU(gate(x)) * up(x))``.

    hidden [T, H]; w13 [E, 2*I, H] (gate rows then up rows, as ``nn.Linear`` weights) and
    w2 [E, H, I], both in hidden's dtype; topk_weights [T, k] (already normalised as the model
    wants: softmax then top-k, renormalised or not); topk_ids [T, k]. Returns [T, H] in hidden's
    dtype. ``config`` overrides the tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps).
    """
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    t, h = hidden.shape
    e, i, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if t == 0:
        return hidden.new_zeros(0, h)
    cfg = {**default_config(t * top_k, e), **(config or {})}
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        check(cfg[name] >= 16 and cfg[name] & (cfg[name] - 1) == 0,
              f"{name} must be a power of two >= 16 (tl.dot's minimum), got {cfg[name]}")
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    align = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e)
    inter = hidden.new_empty(t * top_k, i)  # SiLU(gate) * up per pair, in the model dtype
    _grouped_gemm(hidden, w13, inter, weights, align, i, h, top_k, True, False, cfg)
    down = torch.empty(t * top_k, h, dtype=torch.float32, device=hidden.device)
    _grouped_gemm(inter, w2, down, weights, align, h, i, 1, False, True, cfg)
    return down.view(t, top_k, h).sum(1).to(hidden.dtype)


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The naive loop over experts (as transformers' Mixtral / Qwen3-MoE blocks): gather each
    expert's tokens, run its SwiGLU, scale by the routing weight, scatter-add into the output."""
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    t, h = hidden.shape
    i = w13.shape[1] // 2
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == expert)
        x = hidden[tok].float()
        gate, up = w13[expert, :i].float(), w13[expert, i:].float()
        act = (F.silu(x @ gate.T) * (x @ up.T)).to(hidden.dtype).float()
        y = (act @ w2[expert].float().T) * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)
