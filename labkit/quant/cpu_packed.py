"""Packed weight-only matmuls for CPU decode: the weight is never expanded to float.

PyTorch ships the two CPU kernels gpt-fast uses:

* ``aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])`` = ``x @ (w * scales[:, None]).T``
* ``aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [G, N, 2])``
  = ``x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``, ``g = k //
  group_size``; ``packed`` comes from ``aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K],
  1)`` (two codes a byte, [N, K/2] uint8). Limits (torch 2.13): ``N % 16 == 0``, group size in
  {32, 64, 128, 256}, ``K % group_size == 0``.

Both read each weight byte once, unpack in registers and accumulate in fp32 — which is why
decode (a matrix-vector product per step, bound by the bytes it reads) gets faster with fewer
bits. On x86 only their **bfloat16-activation** paths are vectorised (fp32 activations take a
scalar fallback ~10x slower), so activations and scales are cast to bf16 at the call and the
result back: that rounding (relative 2⁻⁹) is the tolerance of these paths against the reference
dequantize-then-matmul, tested in tests/quant/test_cpu_packed.py.

Which stored formats map onto the INT4 kernel exactly (the integer codes carry over unchanged):
any grid ``W = (q - z) * s`` with q < 16 and contiguous groups — INT4 RTN, AWQ, GPTQ with bits
<= 4 (``zero = (8 - z) * s``). GPTQ with act-order stores ``g_idx`` in a permuted order: if every
group has ``group_size`` members, sorting the input dim by group makes the groups contiguous, so
the layer permutes its activations ``x[..., perm]`` (one gather a call) and the codes stay
exact. NF4 is *not* an integer grid (its 16 levels are normal quantiles), so it keeps the
dequantize path; so do FP8 and any layer that breaks the limits above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.quant import cpu_gemv

INT4_GROUP_SIZES = (32, 64, 128, 256)
ACT_DTYPE = torch.bfloat16
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default  # the overload: skips a dispatch step
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def int4_layout_problem(n: int, k: int, group_size: int) -> str | None:
    """Why (n, k, group_size) cannot use the INT4 CPU kernel, or None if it can."""
    if n % 16:
        return f"out_features {n} is not a multiple of 16"
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} is not one of {INT4_GROUP_SIZES}"
    if k % group_size:
        return f"in_features {k} is not a multiple of the group size {group_size}"
    return None


@dataclass
class Int8Pack:
    """INT8 weight [N, K] and per-channel scales: bf16 for ``_weight_int8pack_mm``, fp32 for
    labkit's prefetching GEMV (:mod:`labkit.quant.cpu_gemv`), which decode (at most
    ``cpu_gemv.MAX_ROWS`` fp32 rows) uses where it could be compiled."""

    qweight: torch.Tensor
    scales: torch.Tensor
    scales_f32: torch.Tensor

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if x2d.shape[0] <= cpu_gemv.MAX_ROWS and x2d.dtype == torch.float32:
            lib = cpu_gemv.library()
            if lib is not None:
                return cpu_gemv.int8_gemv(x2d, self.qweight, self.scales_f32, lib)
        return _INT8_MM(x2d.to(ACT_DTYPE), self.qweight, self.scales).to(x2d.dtype)


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> Int8Pack | None:
    """None when in_features is not a multiple of 16: torch 2.13's ``_weight_int8pack_mm``
    then returns garbage for one row and crashes the process for several (its vector loop
    has no tail), so such a layer keeps the dequantize path."""
    if qweight.shape[1] % 16:
        return None
    return Int8Pack(qweight.to(torch.int8).contiguous(), scales.to(ACT_DTYPE).contiguous(),
                    scales.float().contiguous())


@dataclass
class Int4Pack:
    """Packed INT4 codes, bf16 (scale, zero) per group, and the input permutation (or None)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        xb = x2d.to(ACT_DTYPE)
        if self.perm is not None:
            xb = xb.index_select(1, self.perm)
        return _INT4_MM(xb, self.packed, self.group_size, self.scales_and_zeros).to(x2d.dtype)

    def nbytes(self) -> int:
        extra = 0 if self.perm is None else self.perm.numel() * self.perm.element_size()
        return (self.packed.numel() * self.packed.element_size() + extra +
                self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())


def contiguous_group_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Permutation of the input dim that makes every group contiguous, or None if impossible.

    Returns ``perm`` with ``g_idx[perm] == arange(K) // group_size`` (identity -> None is not
    returned: the caller checks). Impossible when the groups have unequal sizes."""
    g = g_idx.long()
    k = g.numel()
    if k % group_size or torch.bincount(g, minlength=k // group_size).ne(group_size).any():
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(k) // group_size):
        return None
    return perm


def pack_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, group_size: int, bits: int = 4) -> Int4Pack | None:
    """codes [N, K] (0..2^bits-1), zeros and scales [G, N], g_idx [K] -> Int4Pack, or None.

    None when the layer cannot use the kernel (see :func:`int4_layout_problem`, or groups that
    no permutation makes contiguous). Codes of fewer bits are shifted up by ``8 - 2^(bits-1)``
    (the zero point with them), so their grid sits around the kernel's implicit 8 and the bf16
    zero term ``(8 - z) s`` stays small (its rounding error scales with it)."""
    n, k = codes.shape
    if bits > 4 or int4_layout_problem(n, k, group_size):
        return None
    shift = 8 - 2 ** (bits - 1) if bits < 4 else 0
    codes, zeros = codes.to(torch.int32) + shift, zeros.to(torch.int32) + shift
    perm = contiguous_group_perm(g_idx, group_size)
    if perm is None:
        return None
    if torch.equal(perm, torch.arange(k)):
        perm = None
    else:
        codes = codes[:, perm]
    s = scales.float()
    zero_float = (8 - zeros.float()) * s  # (q - z) s = (q - 8) s + (8 - z) s
    sz = torch.stack([s, zero_float], dim=-1).to(ACT_DTYPE).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), 1)
    return Int4Pack(packed, sz, group_size, perm)
