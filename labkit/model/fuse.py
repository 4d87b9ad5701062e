"""Fused projections: q|k|v in one matmul and gate|up in one, applied after loading.

A decoder layer projects the same input three times for attention (q, k, v) and twice for the
MLP (gate, up). Each projection is a separate GEMM launch and, on a CPU or for small batches, a
separate pass of Python and dispatch overhead; one matmul over the concatenated weights does the
same arithmetic in one call (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``).

labkit keeps Hugging Face's separate weights as the storage layout (``labkit.model.layers``
says why) and fuses here, in place: the concatenated weight is one new tensor, and each of
``q_proj/k_proj/v_proj`` (``gate_proj/up_proj``) becomes a *view* of its rows, so the model's
``state_dict``, checkpoint export and TP slicing see the same names and the same memory as
before, and an in-place weight update is seen by the fused matmul too. Only the two seams
change: :meth:`Attention.project_qkv` and :meth:`MLP.gate_up`, overridden on the instance.
Layers whose projections are not plain ``nn.Linear`` (quantized ones) are left as they are, and
so is a mixture-of-experts MLP (:mod:`labkit.model.moe`): its experts are already stacked
gate|up tensors [E, 2I, H] that run through ``fused_experts``; its attention is fused as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedProjection(nn.Module):
    """One linear layer whose output splits into named parts (``sizes`` along the last dim).
    The weight is a non-persistent buffer: the state dict keeps the original modules' names."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: list[int]) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _plain(*mods: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in mods)


def _fuse(parts: list[nn.Linear]) -> FusedProjection:
    """Concatenate ``parts``' weights (and biases) into one tensor and make each part's
    parameters views of it."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse projections where only some have a bias")
    bias = torch.cat([p.bias.detach() for p in parts]) if all(has_bias) else None
    start = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return FusedProjection(weight, bias, [p.out_features for p in parts])


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every decoder layer's q|k|v and gate|up in place; returns how many projections
    were fused (quantized layers, MoE MLPs, which have no gate_proj, and latent attention, which
    has no k_proj, are skipped).
    Idempotent."""
    fused = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not hasattr(a, "qkv_proj") and hasattr(a, "k_proj") and \
                _plain(a.q_proj, a.k_proj, a.v_proj):  # latent attention (MLA) has no k_proj
            a.qkv_proj = _fuse([a.q_proj, a.k_proj, a.v_proj])
            # a bound method, not the module: an instance attribute that shadows the class's
            # method (a Module assigned here would be registered as a child and never called)
            a.project_qkv = a.qkv_proj.__call__
            fused += 1
        if hasattr(m, "gate_proj") and not hasattr(m, "gate_up_proj") and \
                _plain(m.gate_proj, m.up_proj):
            m.gate_up_proj = _fuse([m.gate_proj, m.up_proj])
            m.gate_up = m.gate_up_proj.__call__
            fused += 1
    return fused


def is_fused(model: nn.Module) -> bool:
    return any(hasattr(layer.self_attn, "qkv_proj") for layer in model.model.layers)
