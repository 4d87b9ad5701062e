"""Multi-LoRA for a batch whose rows belong to different adapters (Punica's BGMV and SGMV).

A LoRA adapter adds ``scaling * (x @ A.T) @ B.T`` to a linear layer's output, with A [r, H_in]
and B [H_out, r] of a small rank r. Serving many adapters at once (vLLM's ``enable_lora``) keeps
the base weights shared and stacks the resident adapters' factors per device slot::

    lora_a [S, r, H_in]   lora_b [S, H_out, r]   scalings [S]   (slot s = one resident adapter)

and every row of the batch names its slot (-1: the base model, no delta). Merging an adapter
into the weights would need one copy of the base per adapter; instead the delta is computed in
two skinny steps per batch, whatever mix of adapters it holds:

    shrink   buf[t] = x[t] @ lora_a[slot(t)].T                 [T, r]   (fp32)
    expand   y[t]  += scalings[slot(t)] * buf[t] @ lora_b[slot(t)].T   (in place, base output)

Two layouts of "which row uses which slot", as in Punica and vLLM:
- BGMV (batched gather matrix-vector, decode): ``token_slots[T]``, any slot per row. One
  program per token (and per N tile / K split): a GEMV with the slot's factor gathered by
  pointer; no ``tl.dot``, since one row would be padded to 16 for the tensor cores.
- SGMV (segmented gather matrix-matrix, prefill): ``seg_starts[G+1]`` and ``seg_slots[G]``,
  tokens ``seg_starts[g]:seg_starts[g+1]`` all use slot ``seg_slots[g]`` (a prefill's tokens are
  consecutive). One program per BLOCK_M rows of a segment: an ordinary tile GEMM on the tensor
  cores against that slot's factor.

What bounds them: memory. Shrink reads x and r x H_in of A per token (BGMV) or per block of
BLOCK_M tokens (SGMV); expand reads y twice (load, store) and H_out x r of B. With r = 16 the
delta costs ~2r/H of the base layer's FLOPs, but in decode the factor reads are what the slot
gather adds: a row pays for its own adapter's A and B, never for the other adapters'.

Rows whose slot is -1 are never written by the expand kernels (their programs return first):
the base model's output stays bitwise what it was. Rows of y may be strided (a q/k/v slice of a
fused projection's output); the last dimension must be contiguous.
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
    dot_precision,
    interpreting,
    next_pow2,
    on_host,
)


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, slots_ptr, K, R,
                        stride_xm, stride_as, stride_ar, stride_ps, stride_om,
                        R_PAD: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (t, s): partial s of buf[t] = x[t] @ A[slot].T over every SPLIT_K-th K tile."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return  # base row: buf stays zero
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    a_base = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros([R_PAD], tl.float32)
    for k0 in range(tl.program_id(1) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + t * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + tl.program_id(1) * stride_ps + t * stride_om + offs_r, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(y_ptr, buf_ptr, b_ptr, slots_ptr, scal_ptr, N, R,
                        stride_ym, stride_bufm, stride_bs, stride_bn,
                        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (t, n): y[t, n tile] += scaling[slot] * B[slot][n tile] @ buf[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return  # base row: y is not touched
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    v = tl.load(buf_ptr + t * stride_bufm + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * v[None, :], 1) * tl.load(scal_ptr + slot).to(tl.float32)
    y_ptrs = y_ptr + t * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


@triton.jit
def _segment_rows(starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """Segment g = program_id(2): its slot, program_id(0)'s BLOCK_M rows (int64) and their mask,
    and whether the program has nothing to do (a base segment, or rows past the segment)."""
    g = tl.program_id(2)
    start = tl.load(starts_ptr + g).to(tl.int64)
    end = tl.load(starts_ptr + g + 1).to(tl.int64)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rows = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    idle = (slot < 0) | (start + tl.program_id(0) * BLOCK_M >= end)
    return slot, rows, rows < end, idle


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, starts_ptr, slots_ptr, K, R,
                        stride_xm, stride_as, stride_ar, stride_om,
                        R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m, 0, g): buf[rows] = x[rows] @ A[slot].T for BLOCK_M rows of segment g."""
    slot, rows, row_mask, idle = _segment_rows(starts_ptr, slots_ptr, BLOCK_M)
    if idle:
        return  # base segment (buf stays zero), or past the segment's end
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_t = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                      mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, R_PAD] = A.T
        if DOT_FP32:  # the interpreter's bf16 dot is wrong (see _common.interpreting)
            x = x.to(tl.float32)
            a_t = a_t.to(tl.float32)
        acc = tl.dot(x, a_t, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_r[None, :], acc,
             mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(y_ptr, buf_ptr, b_ptr, starts_ptr, slots_ptr, scal_ptr, N, R,
                        stride_ym, stride_bufm, stride_bs, stride_bn,
                        R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m, n, g): y[rows, n tile] += scaling[slot] * buf[rows] @ B[slot][n tile].T."""
    slot, rows, row_mask, idle = _segment_rows(starts_ptr, slots_ptr, BLOCK_M)
    if idle:
        return  # base segment: y is not touched
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    v = tl.load(buf_ptr + rows[:, None] * stride_bufm + offs_r[None, :],
                mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    b_t = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                  mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [R_PAD, BN] = B.T
    if DOT_FP32:
        b_t = b_t.to(tl.float32)
    # the fp32 shrink output meets B in B's dtype: tensor cores for bf16/fp16 adapters
    acc = tl.dot(v.to(b_t.dtype), b_t, input_precision=PRECISION)
    acc = acc * tl.load(scal_ptr + slot).to(tl.float32)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


# ----------------------------------------------------------------------------- checks


def _check_rows(t: torch.Tensor, name: str, rows: int | None = None) -> None:
    check(t.dim() == 2, f"{name} must be 2-D [T, features], got shape {tuple(t.shape)}")
    check(rows is None or t.shape[0] == rows, f"{name} must have T = {rows} rows, got "
          f"{t.shape[0]}")
    check(t.stride(1) == 1 or t.shape[1] <= 1, f"{name} needs a contiguous last dimension")
    check_dtype(t, name, FLOAT_DTYPES)


def _check_slot_ids(ids: torch.Tensor, name: str, n: int, num_slots: int) -> None:
    check(ids.dim() == 1 and ids.numel() == n, f"{name} must be 1-D with {n} entries, got "
          f"shape {tuple(ids.shape)}")
    check_dtype(ids, name, INDEX_DTYPES)
    if on_host(ids) and n:
        lo, hi = int(ids.min()), int(ids.max())
        check(lo >= -1 and hi < num_slots, f"{name} must be -1 (no adapter) or a slot in "
              f"[0, {num_slots}), got {lo}..{hi}")


def _check_shrink(x, lora_a) -> None:
    _check_rows(x, "x")
    check(lora_a.dim() == 3 and lora_a.shape[2] == x.shape[1],
          f"lora_a must be [S, r, H_in={x.shape[1]}], got {tuple(lora_a.shape)}")
    check(lora_a.dtype == x.dtype, f"lora_a must have x's dtype {x.dtype}, got {lora_a.dtype}")


def _check_expand(y, buf, lora_b, scalings) -> None:
    _check_rows(y, "y")
    _check_rows(buf, "buf", y.shape[0])
    check(lora_b.dim() == 3 and lora_b.shape[1:] == (y.shape[1], buf.shape[1]),
          f"lora_b must be [S, H_out={y.shape[1]}, r={buf.shape[1]}], got {tuple(lora_b.shape)}")
    check(lora_b.dtype == y.dtype, f"lora_b must have y's dtype {y.dtype}, got {lora_b.dtype}")
    check(scalings.dim() == 1 and scalings.numel() == lora_b.shape[0],
          f"scalings must be [S={lora_b.shape[0]}], got {tuple(scalings.shape)}")
    check_dtype(scalings, "scalings", FLOAT_DTYPES)


def _check_segments(seg_starts, seg_slots, num_tokens: int, num_slots: int) -> None:
    check(seg_starts.dim() == 1 and seg_starts.numel() >= 1,
          f"seg_starts must be 1-D [G+1], got shape {tuple(seg_starts.shape)}")
    check_dtype(seg_starts, "seg_starts", INDEX_DTYPES)
    _check_slot_ids(seg_slots, "seg_slots", seg_starts.numel() - 1, num_slots)
    if on_host(seg_starts):
        s = seg_starts.long()
        check(int(s[0]) >= 0 and int(s[-1]) <= num_tokens and bool((s.diff() >= 0).all()),
              f"seg_starts must rise (empty segments allowed) within [0, T={num_tokens}], "
              f"got {s.tolist()}")


def _max_seg_len(seg_starts: torch.Tensor, max_seg_len: int | None) -> int:
    """The grid's rows per segment: given by the caller (the engine knows it on the host) or
    read back here (a device sync)."""
    longest = int(seg_starts.diff().max()) if seg_starts.numel() > 1 else 0
    if max_seg_len is None:
        return longest
    check(not on_host(seg_starts) or max_seg_len >= longest,
          f"max_seg_len {max_seg_len} < the longest segment {longest}")
    return max_seg_len


def _r_pad(r: int) -> int:
    return max(16, next_pow2(r))  # tl.dot's minimum tile side on a GPU


# ----------------------------------------------------------------------------- BGMV


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """buf [T, r] float32 = x[t] @ lora_a[token_slots[t]].T per row; zeros where the slot is -1.

    ``config``: BLOCK_K, SPLIT_K (K split over programs; the partials are summed after, which
    keeps the result deterministic, unlike atomics)."""
    _check_shrink(x, lora_a)
    t, k = x.shape
    _check_slot_ids(token_slots, "token_slots", t, lora_a.shape[0])
    r, r_pad = lora_a.shape[1], _r_pad(lora_a.shape[1])
    cfg = config or {}
    block_k = cfg.get("BLOCK_K", min(next_pow2(k), max(32, 4096 // r_pad)))
    # a decode batch has few rows: split K so that ~256 programs share the reads of A
    split = cfg.get("SPLIT_K", 1 if interpreting() else 256 // max(t, 1))
    split = max(1, min(split, triton.cdiv(k, block_k)))
    part = torch.zeros(split, t, r, dtype=torch.float32, device=x.device)
    if t and r:
        lora_a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
        _bgmv_shrink_kernel[(t, split)](
            x, lora_a, part, token_slots.contiguous(), k, r, x.stride(0), lora_a.stride(0),
            lora_a.stride(1), part.stride(0), part.stride(1),
            R_PAD=r_pad, BLOCK_K=block_k, SPLIT_K=split)
    return part[0] if split == 1 else part.sum(0)


def bgmv_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """y[t] += scalings[s] * buf[t] @ lora_b[s].T with s = token_slots[t], in place; rows with
    s = -1 are not written."""
    _check_expand(y, buf, lora_b, scalings)
    t, n = y.shape
    _check_slot_ids(token_slots, "token_slots", t, lora_b.shape[0])
    r, r_pad = lora_b.shape[2], _r_pad(lora_b.shape[2])
    if not (t and n and r):
        return
    block_n = min(next_pow2(n), max(16, 4096 // r_pad))
    lora_b = lora_b if lora_b.stride(2) == 1 else lora_b.contiguous()
    _bgmv_expand_kernel[(t, triton.cdiv(n, block_n))](
        y, buf, lora_b, token_slots.contiguous(), scalings.contiguous(), n, r, y.stride(0),
        buf.stride(0), lora_b.stride(0), lora_b.stride(1), R_PAD=r_pad, BLOCK_N=block_n)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """y += the LoRA delta of each row's slot (BGMV shrink then expand), in place."""
    bgmv_expand(y, bgmv_shrink(x, lora_a, token_slots), lora_b, token_slots, scalings)


# ----------------------------------------------------------------------------- SGMV


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int | None = None) -> torch.Tensor:
    """buf [T, r] float32: rows seg_starts[g]:seg_starts[g+1] = x[rows] @ lora_a[seg_slots[g]].T;
    zeros for slot -1 and for rows outside every segment."""
    _check_shrink(x, lora_a)
    t, k = x.shape
    _check_segments(seg_starts, seg_slots, t, lora_a.shape[0])
    r = lora_a.shape[1]
    out = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    rows = _max_seg_len(seg_starts, max_seg_len)
    if rows == 0 or r == 0:
        return out
    block_m, block_k = (16 if rows <= 16 else 64), min(64, max(16, next_pow2(k)))
    lora_a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
    grid = (triton.cdiv(rows, block_m), 1, seg_slots.numel())
    _sgmv_shrink_kernel[grid](
        x, lora_a, out, seg_starts.contiguous(), seg_slots.contiguous(), k, r, x.stride(0),
        lora_a.stride(0), lora_a.stride(1), out.stride(0), R_PAD=_r_pad(r), BLOCK_M=block_m,
        BLOCK_K=block_k, DOT_FP32=interpreting(), PRECISION=dot_precision(x.dtype))
    return out


def sgmv_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, scalings: torch.Tensor,
                max_seg_len: int | None = None) -> None:
    """y[rows] += scalings[s] * buf[rows] @ lora_b[s].T for each segment (s = its slot), in
    place; segments with s = -1 and rows outside every segment are not written."""
    _check_expand(y, buf, lora_b, scalings)
    t, n = y.shape
    _check_segments(seg_starts, seg_slots, t, lora_b.shape[0])
    r = lora_b.shape[2]
    rows = _max_seg_len(seg_starts, max_seg_len)
    if rows == 0 or n == 0 or r == 0:
        return
    block_m, block_n = (16 if rows <= 16 else 64), min(64, max(16, next_pow2(n)))
    lora_b = lora_b if lora_b.stride(2) == 1 else lora_b.contiguous()
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n), seg_slots.numel())
    _sgmv_expand_kernel[grid](
        y, buf, lora_b, seg_starts.contiguous(), seg_slots.contiguous(), scalings.contiguous(),
        n, r, y.stride(0), buf.stride(0), lora_b.stride(0), lora_b.stride(1),
        R_PAD=_r_pad(r), BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=interpreting(),
        PRECISION=dot_precision(y.dtype))


# ----------------------------------------------------------------------------- references
# A loop over the slots (or segments) present: each does one ordinary matmul on its rows.


def _shrink_rows(out, x, lora_a, rows, slot) -> None:
    out[rows] = x[rows].float() @ lora_a[slot].float().T


def _expand_rows(y, buf, lora_b, scalings, rows, slot) -> None:
    delta = float(scalings[slot]) * (buf[rows].float() @ lora_b[slot].float().T)
    y[rows] = (y[rows].float() + delta).to(y.dtype)


def bgmv_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    _check_shrink(x, lora_a)
    _check_slot_ids(token_slots, "token_slots", x.shape[0], lora_a.shape[0])
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            _shrink_rows(out, x, lora_a, token_slots == slot, slot)
    return out


def bgmv_expand_ref(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    _check_expand(y, buf, lora_b, scalings)
    _check_slot_ids(token_slots, "token_slots", y.shape[0], lora_b.shape[0])
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            _expand_rows(y, buf, lora_b, scalings, token_slots == slot, slot)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    bgmv_expand_ref(y, bgmv_shrink_ref(x, lora_a, token_slots), lora_b, token_slots, scalings)


def _segments(seg_starts, seg_slots):
    bounds = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot >= 0 and bounds[g + 1] > bounds[g]:
            yield slice(bounds[g], bounds[g + 1]), slot


def sgmv_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor,
                    seg_slots: torch.Tensor, max_seg_len: int | None = None) -> torch.Tensor:
    _check_shrink(x, lora_a)
    _check_segments(seg_starts, seg_slots, x.shape[0], lora_a.shape[0])
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for rows, slot in _segments(seg_starts, seg_slots):
        _shrink_rows(out, x, lora_a, rows, slot)
    return out


def sgmv_expand_ref(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                    seg_starts: torch.Tensor, seg_slots: torch.Tensor, scalings: torch.Tensor,
                    max_seg_len: int | None = None) -> None:
    _check_expand(y, buf, lora_b, scalings)
    _check_segments(seg_starts, seg_slots, y.shape[0], lora_b.shape[0])
    for rows, slot in _segments(seg_starts, seg_slots):
        _expand_rows(y, buf, lora_b, scalings, rows, slot)
