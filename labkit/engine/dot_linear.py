"""Decode's linear layers as dot products, for the compiled pieces (:mod:`labkit.engine.piecewise`).

At batch 1 a decode step multiplies one token's activations by every weight matrix of the
model: each linear layer is a matrix-vector product (GEMV), and its time is the time to read
the weight from memory once. Nothing is reused, so the arithmetic hardly matters; what matters
is how fast a loop streams the weight's rows. llama.cpp's CPU backend is such a loop
(``ggml_vec_dot_f32``: one SIMD dot product per output row).

PyTorch runs ``F.linear`` on a CPU as a call into the BLAS library (MKL's ``sgemm``), built for
matrices that are reused from cache; at one row it streams weights at about a third of a plain
dot-product loop on the lab's CPU (``labkit bench step`` measures both). :func:`dot_linear`
writes the same product as a multiply and a sum over the input features, and inductor turns
that into exactly the loop llama.cpp runs: for each output row, a vectorised multiply-add over
the row, one horizontal sum. Eager, this form would build the [rows, in] product in memory;
it is only ever traced into a compiled piece, whose template layers :func:`use_dot_products`
rewrites (the model itself is untouched).

At 2 or more tokens the loop inductor writes reads each weight once per token, and the library
matmul (which reads it once) wins: the pieces use this form up to ``DOT_MAX_TOKENS`` tokens.
The results equal the matmul's up to float32 summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.model.fuse import FusedProjection


def dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` written as a multiply and a sum over the input features.

    Why: a decode step of a few tokens makes every linear layer a matrix-vector product, and
    its time is the time to read the weight once from memory. Inductor writes this form as one
    vectorised C++ loop per output row that streams the weight (what llama.cpp's ``vec_dot``
    does); the same product as a matmul is a call into the BLAS library, whose ``sgemm`` streams
    weights at about a third of that speed on the lab's CPU (``labkit bench step``).
    Traced inside a compiled piece only (see the module docstring)."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


class _DotLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dot_linear(x, self.weight, self.bias)


class _DotFusedProjection(FusedProjection):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return dot_linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def use_dot_products(template: nn.Module) -> nn.Module:
    """Make a template's plain linears (and fused q|k|v, gate|up) :func:`dot_linear`s, in
    place: the template is the pieces' own weightless copy, the model is untouched."""
    swap = {nn.Linear: _DotLinear, FusedProjection: _DotFusedProjection}
    for m in template.modules():
        if type(m) in swap:
            m.__class__ = swap[type(m)]
    return template
