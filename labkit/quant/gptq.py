"""GPTQ (Frantar et al., 2022): quantize one column at a time, push the error onto the rest.

For a linear layer with inputs X (columns = tokens), the quantization loss is
``||WX - QX||² = tr((W-Q) H (W-Q)ᵀ)`` with ``H = 2XXᵀ``. Quantizing column i introduces error
``e = (w_i - q_i) / [H⁻¹]_ii``; the optimal fix to the not-yet-quantized columns is
``W[:, i+1:] -= e · [H⁻¹]_{i, i+1:}`` (Optimal Brain Surgeon). GPTQ's tricks make this fast and
stable: a fixed column order for all rows, the upper Cholesky factor of H⁻¹ (which already holds
the rows of every successive H⁻¹ it needs), dampening ``λ = damp · mean(diag H)`` added to the
diagonal, and "lazy batch" updates that apply the error of a block of columns to the rest with
one matmul. act-order quantizes columns with the largest ``diag(H)`` first and records each
column's group in ``g_idx``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit.quant.errors import QuantizationError, check_bits, resolve_group_size
from labkit.quant.rtn import GroupQuant, group_params, quantize_codes


class HessianAccumulator:
    """Running ``H = 2/n Σ x xᵀ`` over the input rows a linear layer sees."""

    def __init__(self, in_features: int) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = math.sqrt(2 / self.n) * x
        self.H += x.T @ x


@dataclass
class GPTQResult:
    quant: GroupQuant
    loss: float  # GPTQ's objective Σ (w-q)²/[H⁻¹]_ii²/2 accumulated over columns
    rtn_loss: float  # tr(E H Eᵀ)/2 for plain round-to-nearest, same H, for comparison
    gptq_hloss: float  # tr(E H Eᵀ)/2 for the GPTQ result


def _hloss(err: torch.Tensor, H: torch.Tensor) -> float:
    return float(((err @ H) * err).sum() / 2)


@torch.no_grad()
def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = False, act_order: bool = False, damp: float = 0.01,
                  block_size: int = 128, group_fallback: bool = False) -> GPTQResult:
    """Quantize weight ``W`` [N, K] given the Hessian ``H`` [K, K] of its inputs."""
    check_bits(bits)
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise QuantizationError(f"H must be [K, K] for W [N, K]; got W {tuple(W.shape)}, "
                                f"H {tuple(H.shape)}")
    if not 0 < damp < 1:
        raise QuantizationError(f"damp must be in (0, 1), got {damp}")
    K = W.shape[1]
    gs = resolve_group_size(K, group_size, group_fallback)
    W0 = W.detach().double().clone()
    W, H, Href = _without_dead_inputs(W0, H)
    perm = torch.argsort(torch.diag(H), descending=True) if act_order \
        else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = _hessian_inverse(H, damp)
    codes, scales, zeros, loss = _quantize_blocks(W, Hinv, gs, bits, sym, block_size)

    inv = torch.argsort(perm)
    codes = codes[:, inv]
    g_idx = (torch.arange(K) // gs)[inv].to(torch.int32)
    quant = GroupQuant(codes.to(torch.uint8), torch.stack(scales).float(),
                       torch.stack(zeros).to(torch.int32), g_idx, bits, gs)
    from labkit.quant.rtn import quantize_rtn

    rtn = quantize_rtn(W0.float(), bits, gs, sym).dequantize().double()
    return GPTQResult(quant, loss, _hloss(W0 - rtn, Href),
                      _hloss(W0 - quant.dequantize().double(), Href))


def _without_dead_inputs(W0: torch.Tensor, H: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An input that never fires (zero diagonal) gets H_ii = 1 and a zero weight, so H stays
    invertible; returns (W, H, a copy of that H for the final losses), in float64."""
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W = W0.clone()
    W[:, dead] = 0
    return W, H, H.clone()


def _hessian_inverse(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped H⁻¹: its rows hold every successive H⁻¹ row the
    column-by-column updates need, and dampening keeps the factorisation stable."""
    K = H.shape[0]
    H = H + damp * torch.mean(torch.diag(H)) * torch.eye(K, dtype=H.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def _quantize_blocks(W: torch.Tensor, Hinv: torch.Tensor, gs: int, bits: int, sym: bool,
                     block_size: int) -> tuple[torch.Tensor, list, list, float]:
    """Quantize ``W``'s columns in order (updated in place), each one's error pushed onto the
    columns after it: within a block one column at a time, onto the rest with one matmul per
    block (lazy batch). Returns (codes, scales, zeros per group, GPTQ's objective)."""
    N, K = W.shape
    codes = torch.zeros(N, K, dtype=torch.float64)
    scales, zeros = [], []
    loss = 0.0
    scale = zero = None
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # new group: parameters from the *current* (updated) weights
                block = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :gs]
                scale, zero = (t.double() for t in group_params(block.float(), bits, sym))
                scales.append(scale)
                zeros.append(zero)
            w, d = W1[:, i], Hinv1[i, i]
            q = quantize_codes(w[:, None], scale, zero, bits)[:, 0]
            codes[:, col] = q
            deq = (q - zero) * scale
            loss += float(((w - deq) ** 2).sum() / d**2 / 2)
            err = (w - deq) / d
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return codes, scales, zeros, loss
