"""RMSNorm with an optional fused residual add: ``h = x + residual; y = h / rms(h) * weight``.

In a Llama block the residual add and the next norm are two passes over the hidden state; fusing
them reads x and residual once and writes h and y once. One program per row (token)::

    row n: [ x_0 x_1 ... x_{H-1} ]  ──►  sum of squares (fp32)  ──►  scale every element
           one BLOCK = next_pow2(H) tile, the whole row in registers

What bounds it: memory. ~3 FLOPs per element against 2 bytes read + 2 written (4 + 4 with the
residual): well under 1 FLOP/byte. Rounding follows Hugging Face's Llama: the sum h is rounded to
the model dtype (it is the residual stream), the normalised value is rounded to the dtype before
the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from labkit.kernels._common import FLOAT_DTYPES, check, check_dtype, next_pow2


@triton.jit
def _rms_norm_kernel(
    out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, eps, n_cols,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    normed = (h * tl.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """y = RMSNorm(x) * weight; with ``residual``: (RMSNorm(x + residual) * weight, x + residual).

    x [..., H]; returns tensors shaped like x, in x's dtype (the second one is the new residual
    stream). x and residual need a contiguous last dimension (rows may be strided).
    """
    check(x.dim() >= 1, "x must have a hidden (last) dimension")
    check(x.shape[-1] == weight.numel(),
          f"weight has {weight.numel()} elements, x's last dimension is {x.shape[-1]}")
    check(residual is None or residual.shape == x.shape,
          f"residual shape {None if residual is None else tuple(residual.shape)} != x shape "
          f"{tuple(x.shape)}")
    check_dtype(x, "x", FLOAT_DTYPES)
    check_dtype(weight, "weight", FLOAT_DTYPES)
    check(residual is None or residual.dtype == x.dtype,
          f"residual dtype {None if residual is None else residual.dtype} != x dtype {x.dtype}")
    check(len({t.device for t in (x, weight, residual) if t is not None}) == 1,
          "x, weight and residual must be on one device")
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    check(x2.stride(-1) == 1 and res2.stride(-1) == 1,
          "x and residual need a contiguous last dimension")
    weight = weight.reshape(-1).contiguous()  # read at offsets 0..H-1
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            out, res_out, x2, res2, weight, eps, hidden,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden),
            num_warps=4 if hidden <= 4096 else 8,
        )
    if residual is None:
        return out.view_as(x)
    return out.view_as(x), res_out.view_as(x)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Hugging Face LlamaRMSNorm, with the residual added in the model dtype first."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * normed.to(x.dtype)
    return y if residual is None else (y, x)

