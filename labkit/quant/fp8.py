"""FP8 E4M3 weights: 1 sign, 4 exponent, 3 mantissa bits, largest finite value 448.

Unlike INT8's uniform grid, FP8's levels are dense near zero and sparse far out (relative error
is ~constant, about 2^-4), which suits weights' bell-shaped distributions. One fp32 scale per
output channel maps the row's max |w| to 448 so the whole range is used. Ada (L4, L40S), Hopper
and Blackwell GPUs multiply FP8 natively (Blackwell also FP4: NVFP4/MXFP4); here it is a storage
format dequantized before the matmul.
"""

from __future__ import annotations

import torch

from labkit.quant.errors import QuantizationError

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weight float8_e4m3fn [N, K], scale fp32 [N]) with ``w ≈ q.float() * scale``."""
    if FP8_DTYPE is None:
        raise QuantizationError("this torch has no float8_e4m3fn dtype (needs torch >= 2.1)")
    if w.dim() != 2 or not w.is_floating_point():
        raise QuantizationError(f"expected a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # round-to-nearest-even
    return q, scale
