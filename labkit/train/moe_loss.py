"""The two auxiliary losses that keep a mixture of experts trainable.

Without help a router collapses: the experts that win early get the gradient, get better and
win more, and the rest starve. Two terms are added to the language-model loss, both computed
from the router logits each :class:`~labkit.model.moe.SparseMoeBlock` records in its forward
(``routing(model)``: references to the forward's own tensors, so the gradient flows back into
every router):

* **load balancing** (Switch Transformer, Mixtral): ``E * sum_e f_e * P_e`` with ``f_e`` the
  fraction of the T*k routing slots that chose expert e (not differentiable: it only weights)
  and ``P_e`` the mean router probability of e (differentiable). It is 1.0 when the load and the
  probabilities are uniform, and grows as both concentrate on the same experts. (Hugging Face's
  ``load_balancing_loss_func`` divides by T instead of T*k, so its value is k times this one.)
* **router z-loss** (ST-MoE): ``mean_t logsumexp(logits_t)^2``, which keeps the logits small so
  the float32 softmax stays well conditioned, and the bf16 matmul that produced them accurate.

Both are averaged over the MoE layers; the preset holds their coefficients.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.model.moe import routing


def load_balancing_loss(router_logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` for one layer: logits [T, E], the chosen experts [T, k]."""
    num_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts).to(probs.dtype)
    f = counts / topk_ids.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` for one layer (float32)."""
    return torch.logsumexp(router_logits.float(), dim=-1).square().mean()


def moe_aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"balance", "z"}`` averaged over the MoE layers of ``model``'s last forward (empty for a
    dense model). Raises if a recorded forward's logits carry no gradient while the model is
    training, since the aux losses would then silently not train the router."""
    rec = routing(model)
    if not rec:
        return {}
    if model.training and torch.is_grad_enabled():
        if not all(r.router_logits.requires_grad for r in rec.values()):
            raise RuntimeError("router logits in the routing record are detached; the MoE "
                               "auxiliary losses would not reach the routers")
    balance = torch.stack([load_balancing_loss(r.router_logits, r.topk_ids)
                           for r in rec.values()]).mean()
    z = torch.stack([router_z_loss(r.router_logits) for r in rec.values()]).mean()
    return {"balance": balance, "z": z}
