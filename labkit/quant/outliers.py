"""LLM.int8() (Dettmers et al., 2022) in miniature: why plain INT8 *activations* break, and the fix.

Past ~6.7B parameters a few hidden-state feature dimensions carry values 20-100x larger than
the rest, in almost every token. Absmax INT8 quantization of a row of X then spends its whole
range on the outlier and rounds every normal value to 0 or ±1. LLM.int8 splits the matmul:

    X W = X[:, O] W[O, :]  (outlier columns, kept in 16-bit)
        + X[:, ~O] W[~O, :] (everything else: vector-wise INT8 — rows of X, columns of W)

where O = feature dims in which any |x| exceeds a threshold (6.0 in the paper). Only ~0.1% of
the dimensions are outliers, so nearly all the work still happens in INT8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def int8_vectorwise_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] with absmax INT8 per row of x and per column of w, int32 accumulate."""
    sx = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    sw = (w.abs().amax(dim=0, keepdim=True) / 127).clamp(min=1e-12)
    qx = torch.round(x / sx).to(torch.int32)
    qw = torch.round(w / sw).to(torch.int32)
    return (qx @ qw).float() * sx * sw  # integer matmul, then rescale


@dataclass
class OutlierReport:
    output: torch.Tensor
    outlier_dims: torch.Tensor  # the feature dims kept in high precision
    error_plain_int8: float  # relative error of int8 on everything
    error_decomposed: float  # relative error of the decomposition


def int8_outlier_matmul(x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0
                        ) -> OutlierReport:
    """LLM.int8 decomposition of ``x @ w`` (x [M, K], w [K, N]), with errors vs fp32."""
    x, w = x.float(), w.float()
    ref = x @ w
    outliers = (x.abs() > threshold).any(dim=0)
    normal = ~outliers
    out = x[:, outliers] @ w[outliers, :]  # the 16-bit part (fp32 here)
    if normal.any():
        out = out + int8_vectorwise_matmul(x[:, normal], w[normal, :])
    plain = int8_vectorwise_matmul(x, w)
    norm = ref.norm().clamp(min=1e-12)
    return OutlierReport(out, outliers.nonzero().flatten(), float((plain - ref).norm() / norm),
                         float((out - ref).norm() / norm))
