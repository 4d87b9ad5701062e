"""Reference solutions of the MoE routing exercise (read only by ``inject`` and the tests)."""

from __future__ import annotations

import torch


def topk_gating(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def dispatch(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


def combine(expert_out: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
            num_tokens: int) -> torch.Tensor:
    k = topk_weights.shape[1]
    w = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32)
    out.index_add_(0, order // k, expert_out.float() * w[:, None])
    return out.to(expert_out.dtype)
