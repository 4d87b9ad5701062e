"""Sparse mixture-of-experts MLP: a router picks k of E SwiGLU experts per token.

A dense layer runs every token through one wide MLP. An MoE layer holds E narrower MLPs (the
*experts*) and a *router* (``gate``, one linear layer [E, H]): per token it scores every expert,
keeps the k best and sums their outputs weighted by the router's probabilities. A token pays for
k experts while the layer stores E, which is how Mixtral-8x7B runs at the cost of ~13B active
parameters while holding 47B. The three architectures labkit loads differ only in details::

    probs = softmax(router_logits)                  # over all E experts, in float32
    w, ids = topk(probs, k)                         # softmax BEFORE top-k
    w /= w.sum(-1)            if renormalise        # Mixtral always; Qwen iff norm_topk_prob
    y = sum_j w_j * expert_{ids_j}(x)
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)      # Qwen2-MoE only

**Storage.** The experts of a layer are stacked, as transformers 5 and vLLM keep them in memory:
``experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``experts.down_proj`` [E, H, I]. Those are exactly the ``w13`` / ``w2`` that
:meth:`SparseMoeBlock.fused_experts` takes, so a grouped kernel gets them with no copy. On disk
(what ``save_pretrained`` writes) each expert is separate: ``mlp.experts.{e}.gate_proj.weight``
(Qwen) or ``block_sparse_moe.experts.{e}.w1.weight`` (Mixtral: w1 gate, w3 up, w2 down, and the
router at ``block_sparse_moe.gate``). :meth:`SparseMoeBlock.checkpoint_tensors` names every
on-disk tensor and hands the loader a *view* of its slice of the stacked parameter, so stacking
happens once, while loading, in place (:func:`checkpoint_state_dict` is the way back for export).
In-memory names therefore equal transformers' ``model.state_dict()``.

**Routing is visible.** Each block keeps a reference to its last forward's ``router_logits``
[T, E] and ``topk_ids`` [T, k] (no copy); :func:`routing` collects them per layer. The engine's
trace reads them through :class:`ExpertLoadProbe`: each step's record of an MoE model carries
``expert_load`` [MoE layers][E] (tokens routed to each expert in that step's forward), with the
layers in ``trace.meta["moe_layers"]``.

**Not every feature handles experts.** Weight quantization, GGUF export, pruning, and tensor
parallelism without ``enable_expert_parallel`` (:mod:`labkit.parallel.expert` places experts on
ranks) address weights by the dense names; they call :func:`refuse_moe` and raise
:class:`~labkit.errors.MoEUnsupportedError` naming themselves and the architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import MoEUnsupportedError
from labkit.model.config import ModelConfig
from labkit.model.config_sliding import refuse_family
from labkit.model.layers import register_mlp
from labkit.model.llama import MLP
from labkit.model.mla import refuse_mla

#: (hidden [T,H], w13 [E,2I,H], w2 [E,H,I], topk_weights [T,k] f32, topk_ids [T,k] i64) -> [T,H]
FusedExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        torch.Tensor]


def fused_experts_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference: one expert at a time over the tokens routed to it.

    Dispatch is a permutation: sort the T*k (token, slot) pairs by expert, so each expert's
    tokens are one contiguous run (what ``moe_align_block_size`` pads to blocks in a fused
    kernel); gather them, run the expert's SwiGLU, scale by the routing weight and scatter-add
    back to the token (the combine). Sums accumulate in float32 and are cast once at the end."""
    T, H = hidden.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = token_of[start:start + n]
        gate, up = F.linear(hidden.index_select(0, idx), w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, idx, y.float() * weight_of[start:start + n, None])
        start += n
    return out.to(hidden.dtype)


@dataclass
class RoutingRecord:
    """One MoE layer's routing in its last forward (references, not copies)."""

    router_logits: torch.Tensor  # [T, E], the model's dtype
    topk_ids: torch.Tensor  # [T, k] int64, best expert first

    def expert_load(self) -> list[int]:
        """Tokens routed to each expert (a token counts once per slot it chose)."""
        return torch.bincount(self.topk_ids.reshape(-1),
                              minlength=self.router_logits.shape[-1]).tolist()


class Experts(nn.Module):
    """E SwiGLU experts, stacked: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


@register_mlp("moe")
class SparseMoeBlock(nn.Module):
    """Router (``gate``), stacked ``experts``, and Qwen2-MoE's gated ``shared_expert``."""

    first_expert = 0  # the global index of experts[0] (an expert-parallel rank holds a range)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.architecture = config.architecture
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, h, config.expert_intermediate_size)
        s = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config, intermediate_size=s) if s else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if s else None
        self.last_routing: RoutingRecord | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T,H] -> (router_logits [T,E], topk_weights [T,k] float32, topk_ids [T,k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, ids

    def fused_experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The one place the experts run: a grouped kernel replaces only this
        (:func:`use_fused_experts`); the reference is :func:`fused_experts_loop`."""
        return fused_experts_loop(hidden, w13, w2, topk_weights, topk_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, ids = self.route(x)
        self.last_routing = RoutingRecord(logits, ids)
        out = self.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj,
                                 weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)

    def expert_tensor_names(self, prefix: str, expert: int) -> tuple[str, str, str]:
        """The on-disk names of expert ``expert``'s gate, up and down weights."""
        if self.architecture == "MixtralForCausalLM":
            ex = prefix.removesuffix(".mlp") + f".block_sparse_moe.experts.{expert}"
            return f"{ex}.w1.weight", f"{ex}.w3.weight", f"{ex}.w2.weight"
        ex = f"{prefix}.experts.{expert}"
        return f"{ex}.gate_proj.weight", f"{ex}.up_proj.weight", f"{ex}.down_proj.weight"

    def checkpoint_tensors(self, prefix: str) -> dict[str, tuple[str, torch.Tensor]]:
        """On-disk name -> (the parameter it fills, a view of its slice), for the loader.

        ``prefix`` is this module's name in the model (``model.layers.3.mlp``). The stacked
        row e holds expert ``first_expert + e`` (expert parallelism keeps a range)."""
        inter, E = self.experts.intermediate_size, self.experts.num_experts
        gu, down = self.experts.gate_up_proj.detach(), self.experts.down_proj.detach()
        gu_name, down_name = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for e in range(E):
            g, u, d = self.expert_tensor_names(prefix, self.first_expert + e)
            out[g] = (gu_name, gu[e, :inter])
            out[u] = (gu_name, gu[e, inter:])
            out[d] = (down_name, down[e])
        base = prefix.removesuffix(".mlp") + ".block_sparse_moe"
        if self.architecture == "MixtralForCausalLM":
            out[f"{base}.gate.weight"] = (f"{prefix}.gate.weight", self.gate.weight.detach())
        return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def routing(model: nn.Module) -> dict[int, RoutingRecord]:
    """Layer index -> the routing of that MoE layer's last forward (layers not run yet, and
    dense layers, are absent). The tensors are the forward's own, not copies."""
    return {m.layer_idx: m.last_routing for m in model.modules()  # any router's record:
            if getattr(m, "last_routing", None) is not None}  # also gpt-oss's GptOssMoE


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Layer index -> tokens routed to each expert in the last forward."""
    return {i: r.expert_load() for i, r in routing(model).items()}


class ExpertLoadProbe:
    """Called once per engine step by the trace observer (``LLMEngine.from_model`` installs it
    for an MoE model): the expert load of the step's forward, one row per MoE layer (in
    ``layers`` order) of E token counts, or None when no forward ran since the last call (an
    idle or preemption-only step must not repeat the previous step's load)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = model.config.moe_layers
        self.num_experts = model.config.num_experts
        self._last: dict[int, RoutingRecord] = {}

    def __call__(self) -> list[list[int]] | None:
        rec = routing(self.model)
        if not rec or all(self._last.get(i) is r for i, r in rec.items()):
            return None
        self._last = rec
        return [rec[i].expert_load() if i in rec else [0] * self.num_experts
                for i in self.layers]


def use_fused_experts(model: nn.Module, fn: FusedExperts | None) -> int:
    """Run every MoE layer's experts through ``fn`` (a grouped kernel with
    :meth:`SparseMoeBlock.fused_experts`'s signature); None restores the loop. Returns the
    number of layers changed."""
    blocks = moe_blocks(model)
    for b in blocks:
        if fn is None:
            b.__dict__.pop("fused_experts", None)
        else:
            b.fused_experts = fn
    return len(blocks)


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each stacked expert tensor split back into the per-expert
    names ``save_pretrained`` writes (the inverse of the loader's views)."""
    state = dict(model.state_dict())
    for name, block in model.named_modules():
        if isinstance(block, SparseMoeBlock):
            for disk, (param, view) in block.checkpoint_tensors(name).items():
                state.pop(param, None)
                state[disk] = view
    return state


def refuse_moe(config: ModelConfig, feature: str) -> None:
    """Raise :class:`MoEUnsupportedError` if ``config`` has MoE layers: the guard of every
    feature that addresses MLP weights by the dense names (and, first, MLA's refusal: those
    features address attention by the dense names as well)."""
    refuse_mla(config, feature)  # MLA: no q/k/v_proj either (DeepSeek-V3 dense or sparse)
    layers = config.moe_layers if hasattr(config, "moe_layers") else []
    if layers:
        raise MoEUnsupportedError(feature, config.architecture, layers)
    refuse_family(config, feature)  # Gemma 3's layer is not Llama's
