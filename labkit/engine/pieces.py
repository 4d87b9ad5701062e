"""The functions a compiled step runs, cut where the KV cache plugs in.

:mod:`labkit.engine.piecewise` compiles each of these as one piece (attention eager between
them); :mod:`labkit.engine.full_graph` runs them around its in-graph attention. They call
``.forward`` of the norms and the MLP directly, so module hooks are never traced into a graph.
"""

from __future__ import annotations

import torch
from torch import nn


def pre_attention(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Residual add + input norm, q|k|v, rotary: layer's work before the KV cache."""
    h, residual = layer.input_layernorm.forward(x, residual)
    q, k, v = layer.self_attn.qkv_rope(h, cos, sin)
    return q, k, v, residual


def post_attention(layer: nn.Module, out: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj, residual add + post-attention norm, MLP: layer's work after the KV cache."""
    x = layer.self_attn.o_proj(out.flatten(-2))
    h, residual = layer.post_attention_layernorm.forward(x, residual)
    return layer.mlp.forward(h), residual


def between_attention(layer: nn.Module, nxt: nn.Module, out: torch.Tensor,
                      residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
    """post_attention of one layer and pre_attention of the next: all the work between two
    attention calls is one piece (L + 1 calls per step, not 2L)."""
    x, residual = post_attention(layer, out, residual)
    return pre_attention(nxt, x, residual, cos, sin)


def last_attention(layer: nn.Module, out: torch.Tensor, residual: torch.Tensor
                   ) -> torch.Tensor:
    """The last layer's post_attention and the final residual add (the final norm stays eager:
    hooks on ``model.norm`` read its input)."""
    x, residual = post_attention(layer, out, residual)
    return x + residual


def lm_head(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return head.forward(x)
