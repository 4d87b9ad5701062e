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

Two more cures of the same kind, and :func:`fuse_model`, which applies all three (what
``labkit.LLM(..., fused=True)`` does):

* **residual add fused into the norm** (:func:`fuse_add_norm`): every RMSNorm in a decoder follows
  a residual add. vLLM carries the residual beside the hidden state and hands both to the norm
  (``RMSNorm(x, residual)`` returns the normed sum *and* the sum), so one kernel reads and writes
  the stream once (``kernels/rms_norm.py``). Here the seam is :meth:`LlamaModel.forward`, the
  layer loop: overridden on the instance by :func:`_fused_stack`; ``DecoderLayer`` is unchanged.
  The same additions in the same order, so the outputs are the unfused model's, bit for bit.
* **a rotary table** (:func:`use_rope_table`): cos/sin for every position computed once at
  transform time (vLLM's ``cos_sin_cache``), looked up by position in each step instead of
  recomputed (an arange, a multiply, a concat, cos, sin per step). Memory: max positions x
  head_dim x 2 values (2048 x 64 x 2 float32 = 1 MiB for labkit-tiny).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.config_sliding import refuse_family


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


def _fused_stack(stack: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, kv_cache: Any) -> torch.Tensor:
    """``LlamaModel.forward`` with vLLM's residual stream: each norm adds the residual it
    follows, ``x, residual = norm(x, residual)`` (the layers' attention and MLP unchanged)."""
    residual = None
    for layer in stack.layers:
        if residual is None:
            residual, x = x, layer.input_layernorm(x)
        else:
            x, residual = layer.input_layernorm(x, residual)
        x = layer.self_attn(x, cos, sin, positions, kv_cache)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
    # the last add stays outside the norm: hooks on model.norm (EAGLE's feature capture,
    # labkit.spec) read the final hidden state as its input
    return stack.norm(x + residual)


def fuse_add_norm(model: nn.Module) -> bool:
    """Route the decoder stack through :func:`_fused_stack` (in place). False when it already
    is, or the stack is not labkit's (a stand-in without ``input_layernorm``)."""
    stack = model.model
    if "forward" in vars(stack) or not all(hasattr(la, "post_attention_layernorm")
                                           for la in stack.layers):
        return False
    stack.forward = types.MethodType(_fused_stack, stack)
    return True


def _rope_lookup(self: nn.Module, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)


@torch.no_grad()
def use_rope_table(model: nn.Module) -> bool:
    """Precompute cos/sin for positions ``0 .. max_position_embeddings - 1`` (non-persistent
    buffers: they follow ``model.to`` and stay out of the state dict) and make
    ``model.rope`` a lookup. The forward already refuses a position past the table. False when
    the model already has one."""
    from labkit.model.llama import rope_cos_sin

    if "rope" in vars(model):
        return False
    c = model.config
    pos = torch.arange(c.max_position_embeddings, device=model.device)
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, model.dtype, c.rope_scaling,
                            c.max_position_embeddings)
    model.register_buffer("rope_cos", cos, persistent=False)
    model.register_buffer("rope_sin", sin, persistent=False)
    model.rope = types.MethodType(_rope_lookup, model)
    return True


def fuse_model(model: nn.Module) -> dict[str, Any]:
    """All three cures, in place: q|k|v and gate|up (where the layers are plain linears), the
    residual add in the norms, the rotary table. Returns what was applied (a second call
    applies nothing). gpt-oss and Gemma 3 refuse (their layers are not the Llama layer that
    the fused stack rewrites: ArchitectureUnsupportedError)."""
    refuse_family(model.config, "fused layers (fuse_model)")
    return {"projections": fuse_projections(model), "add_norm": fuse_add_norm(model),
            "rope_table": use_rope_table(model)}
