"""Round-to-nearest integer quantization: per-channel INT8 (W8A16) and group-wise INT4.

Every weight-only format is the same idea: store small integers ``q`` plus a few floats per
group, and rebuild ``W ≈ (q - zero) * scale`` just before the matmul. The choices are how many
bits, how big a group shares one (scale, zero), and whether the grid is symmetric around 0.
GPTQ and AWQ reuse these quantizers; they only change *which* weights get rounded which way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.quant.errors import QuantizationError, check_bits, resolve_group_size


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise QuantizationError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise QuantizationError(f"expected a floating-point weight, got {w.dtype}")


# ---- INT8 per output channel (W8A16) ---------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: ``q = round(w / s)``, ``s = max|w_row| / 127``.

    Returns ``(q int8 [N, K], scale fp16 [N])``. The scale is rounded to fp16 *before* q is
    computed, so the stored (q, scale) pair reproduces exactly what was evaluated.
    """
    _check_weight(w)
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).half()
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


# ---- group-wise asymmetric INT-n (INT4 RTN) --------------------------------------------------
@dataclass
class GroupQuant:
    """Integer codes plus per-group parameters, in the *unpacked* form every packer starts from.

    codes [N, K] uint8 in [0, 2^bits); scales [G, N] float32 (already fp16-representable);
    zeros [G, N] int32; g_idx [K] int32 (group of each input column). ``W = (q - z) * s``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.codes.float() - self.zeros.T[:, g].float()) * self.scales.T[:, g]


def group_params(w: torch.Tensor, bits: int, sym: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) for each row of ``w`` [N, K_group] — GPTQ's min/max rule.

    The range always includes 0 (so zero is an integer in [0, maxq] and exact zeros stay
    exact); symmetric puts the zero at the middle of the grid.
    """
    maxq = 2**bits - 1
    wmin = w.amin(dim=1).clamp(max=0)
    wmax = w.amax(dim=1).clamp(min=0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        wmin = -wmax
    same = (wmax - wmin) == 0
    wmin, wmax = torch.where(same, -1.0, wmin), torch.where(same, 1.0, wmax)
    scale = ((wmax - wmin) / maxq).half().float()  # what the checkpoint will store
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """Nearest grid point: ``clamp(round(w / s) + z, 0, maxq)``; scale/zero broadcast on rows."""
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 2**bits - 1)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                 group_fallback: bool = False) -> GroupQuant:
    """Group-wise round-to-nearest: each run of ``group_size`` input columns shares (s, z)."""
    _check_weight(w)
    check_bits(bits)
    N, K = w.shape
    gs = resolve_group_size(K, group_size, group_fallback)
    w = w.float()
    codes = torch.empty(N, K, dtype=torch.uint8)
    scales, zeros = [], []
    for g0 in range(0, K, gs):
        s, z = group_params(w[:, g0:g0 + gs], bits, sym)
        codes[:, g0:g0 + gs] = quantize_codes(w[:, g0:g0 + gs], s, z, bits).to(torch.uint8)
        scales.append(s)
        zeros.append(z)
    g_idx = (torch.arange(K) // gs).to(torch.int32)
    return GroupQuant(codes, torch.stack(scales), torch.stack(zeros).to(torch.int32), g_idx,
                      bits, gs)


def fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = False, group_fallback: bool = False) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype): what the model will actually compute."""
    return quantize_rtn(w, bits, group_size, sym, group_fallback).dequantize().to(w.dtype)
