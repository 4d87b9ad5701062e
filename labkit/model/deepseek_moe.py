"""DeepSeekMoE: the sparse MLP of DeepSeek-V3, on :mod:`labkit.model.moe`'s machinery.

The experts, their stacked storage, the per-expert checkpoint names, the routing record and the
fused-experts seam are :class:`~labkit.model.moe.SparseMoeBlock`'s. Two things differ, and only
they are written here:

**The router** (:func:`grouped_topk`, vLLM's name; :meth:`DeepseekMoE.route` is the seam)::

    s      = sigmoid(gate(x))                            # per expert, independent: no softmax
    choice = s + e_score_correction_bias                 # the bias steers *which* experts ...
    groups: n_group groups of E / n_group experts; a group's score = sum of its top-2 choices
    keep the topk_group best groups, then the top-k experts of `choice` inside them
    w      = s[chosen]                                   # ... but not their weights
    w     /= w.sum() + 1e-20           if norm_topk_prob
    w     *= routed_scaling_factor

The bias is DeepSeek-V3's auxiliary-loss-free balancing: training nudges an overloaded expert's
bias down so fewer tokens pick it, without a loss term that would distort the weights. Group
limits bound how many devices (one group per node in DeepSeek's deployment) a token's experts
span, which bounds the all-to-all traffic of expert parallelism.

**Shared experts**: ``n_shared_experts`` always-on SwiGLU experts, stored as one MLP of width
``moe_intermediate_size * n_shared_experts`` (``mlp.shared_experts``), added ungated (Qwen2-MoE
gates its one shared expert by a sigmoid; DeepSeek does not).

The router runs in float32 (transformers keeps ``gate.weight`` and the bias in float32 for that
reason); ``e_score_correction_bias`` is a frozen parameter here (a buffer in transformers) so the
loader fills it by name like every other tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.layers import register_mlp
from labkit.model.llama import MLP
from labkit.model.moe import SparseMoeBlock


def grouped_topk(router_logits: torch.Tensor, top_k: int, e_score_correction_bias: torch.Tensor,
                 n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64), best
    choice first. See the module docstring for the rule."""
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores + e_score_correction_bias.float()
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.repeat_interleave(E // n_group, dim=1)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@register_mlp("deepseek_moe")
class DeepseekMoE(SparseMoeBlock):
    """The grouped sigmoid router and ungated shared experts over SparseMoeBlock's experts."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # gate [E, H], experts; no Qwen-style shared expert
        r = config.deepseek_moe
        self.n_group, self.topk_group = r.n_group, r.topk_group
        self.routed_scaling_factor = r.routed_scaling_factor
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts),
                                                         requires_grad=False)
        inter = config.expert_intermediate_size * r.n_shared_experts
        self.shared_experts = MLP(config, intermediate_size=inter) if inter else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T,H] -> (router_logits [T,E] float32, topk_weights [T,k] float32, topk_ids)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.top_k, self.gate.e_score_correction_bias,
                                    self.n_group, self.topk_group, self.norm_topk_prob,
                                    self.routed_scaling_factor)
        return logits, weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
