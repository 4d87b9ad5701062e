"""gpt-oss's mixture of experts: a biased router, softmax over the chosen, clamped SwiGLU experts.

The attention of gpt-oss is labkit's :class:`~labkit.model.llama.Attention` with biases on q, k,
v, o and per-head sinks (:mod:`labkit.model.sinks`), alternating sliding (window 128) and full
layers through ``layer_types``, with YaRN rope (:mod:`labkit.model.rope`). Every MLP is this
module's :class:`GptOssMoE` (``LayerSpec.mlp == "gpt_oss_moe"``), which differs from
:class:`~labkit.model.moe.SparseMoeBlock` in three places::

    logits = router(x)                      # a Linear WITH a bias, [T, E]
    top, ids = topk(logits, k)              # top-k of the logits ...
    w = softmax(top)                        # ... then softmax over the k chosen only
    g, u = (x @ gate_up_proj[e] + gate_up_proj_bias[e]) split INTERLEAVED: [..., 0::2], [..., 1::2]
    g = clamp(g, max=limit);  u = clamp(u, -limit, limit)
    y_e = ((u + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e]

The clamp bounds the activations (gpt-oss ships in MXFP4, where an outlier costs the whole
block's precision); ``u + 1`` lets an expert pass ``g * sigmoid(alpha g)`` through at u = 0.

**Storage = transformers' names and layout**, so the checkpoint loads 1:1: ``router.weight``
[E, H], ``router.bias`` [E], ``experts.gate_up_proj`` [E, H, 2I] (input-major: ``x @ W``, gate
and up *interleaved* column by column), ``experts.gate_up_proj_bias`` [E, 2I],
``experts.down_proj`` [E, I, H], ``experts.down_proj_bias`` [E, H]. That layout is not
:class:`SparseMoeBlock`'s ``w13`` [E, 2I, H], so the grouped-kernel seam (``fused_experts``)
and expert parallelism do not apply; the features that address MLP weights by name refuse the
model through :func:`labkit.model.moe.refuse_moe` (every gpt-oss layer is MoE).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.layers import register_mlp
from labkit.model.moe import RoutingRecord


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on the interleaved [..., 2I] projection -> [..., I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """E experts with biases, stacked input-major as transformers keeps them."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


@register_mlp("gpt_oss_moe")
class GptOssMoE(nn.Module):
    """gpt-oss's MLP: ``router`` and ``experts`` (see the module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, E = config.hidden_size, config.num_experts
        self.layer_idx, self.top_k = layer_idx, config.num_experts_per_tok
        self.alpha, self.limit = config.gpt_oss.swiglu_alpha, config.gpt_oss.swiglu_limit
        self.router = nn.Linear(h, E, bias=True)
        self.experts = GptOssExperts(E, h, config.expert_intermediate_size)
        self.last_routing: RoutingRecord | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T,H] -> (router_logits [T,E], topk_weights [T,k] float32, topk_ids [T,k])."""
        logits = self.router(x)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top.float(), dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, ids = self.route(x)
        self.last_routing = RoutingRecord(logits, ids)
        ex = self.experts
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # group the (token, slot) pairs by expert
        token_of, weight_of = order // self.top_k, weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=ex.num_experts).tolist()):
            if n:
                idx = token_of[start:start + n]
                gu = x.index_select(0, idx) @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                y = clamped_swiglu(gu, self.alpha, self.limit) @ ex.down_proj[e]
                y = y + ex.down_proj_bias[e]
                out.index_add_(0, idx, y.float() * weight_of[start:start + n, None])
                start += n
        return out.to(x.dtype).view(shape)
