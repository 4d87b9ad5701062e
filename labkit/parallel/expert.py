"""Expert parallelism: each rank holds E/N whole experts, and the tokens travel to them.

Tensor parallelism would slice every expert's matmuls N ways: tiny GEMMs and one all-reduce of
all tokens per layer. Expert parallelism (``LLM(..., tensor_parallel_size=N,
enable_expert_parallel=True)``, vLLM's flag) instead *places* experts: rank r holds experts
``r*E/N .. (r+1)*E/N - 1`` of every MoE layer, whole, and each (token, slot) pair is sent to the
rank that owns its expert. Attention and the dense parts stay tensor parallel, so after the
attention's all-reduce every rank holds all T tokens of the step. One MoE layer on rank r::

    tokens   t_r = the r-th contiguous share of the T tokens  (token_split: T//N, +1 for the
                                                               first T%N ranks; vLLM's
                                                               sequence-parallel MoE chunk)
    route    the router (replicated: every rank has the whole gate) picks k experts per token
    counts   all_to_all of int64 [E]: how many of my pairs go to each expert (the owner learns
             how many rows of each of its experts arrive from each rank)
    dispatch all_to_all of the pairs' activations, [t_r*k, H], sorted by expert, so the rows
             for rank d are one contiguous run (the chunk for myself is copied locally)
    experts  the owner runs its experts on what arrived (``fused_experts``: the loop, or the
             Triton kernel with attention_backend="triton"), weight 1 per row
    combine  all_to_all back, the reverse split: every pair's expert output returns to the
             rank that sent it, which applies the routing weights and sums the k slots
    shared   Qwen2-MoE's gated shared expert is replicated and runs on the rank's own tokens
    gather   all_gather of the t_r finished rows (padded to ceil(T/N)): every rank holds all T
             tokens again, as the next layer's tensor-parallel attention needs

So per MoE layer and step, summed over the ranks, the dispatch moves exactly
``T * top_k * hidden * dtype_bytes`` and the combine the same (``T`` = the tokens of the
step's forward, ``num_batched_tokens``: every rank dispatches only its share, so each
(token, slot) pair is sent once). That is the payload handed to ``all_to_all_single``,
including each rank's chunk for itself; ``remote_bytes`` counts only the rows addressed to
another rank (depends on the routing: about (N-1)/N of it when experts are picked uniformly).
The counts (E int64 per rank) and the gather (N * ceil(T/N) * H per layer) are logged as their
own kinds, so the formula can be checked on the activations alone
(:func:`labkit.sim.expert.all_to_all_bytes` is that formula; the simulator prices it at scale).

The all-to-alls are ``torch.distributed.all_to_all_single`` with uneven splits, which gloo
(CPU) implements as well as NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.model.config import ModelConfig
from labkit.model.moe import Experts, RoutingRecord, SparseMoeBlock
from labkit.parallel.comm import TPGroup
from labkit.parallel.plan import ShardPlan


def token_split(num_tokens: int, world: int) -> list[int]:
    """How many of the step's tokens each rank dispatches: contiguous shares, the first
    ``num_tokens % world`` ranks one more (a rank may get none)."""
    base, extra = divmod(num_tokens, world)
    return [base + (r < extra) for r in range(world)]


@dataclass
class Dispatched:
    """What a rank keeps between dispatch and combine (everything is in *send* order)."""

    token_of: torch.Tensor  # [t_r*k] the token each sent row belongs to
    weights: torch.Tensor   # [t_r*k] float32 routing weight of each sent row
    send: list[int]         # rows sent to each rank
    recv: list[int]         # rows received from each rank


def dispatch(group: TPGroup, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             experts_per_rank: int, site: str = "") -> tuple[torch.Tensor, torch.Tensor,
                                                             Dispatched]:
    """Send every (token, slot) pair of ``x`` [t,H] to the owner of its expert ``ids`` [t,k].

    Returns the rows that arrived here [M,H] (rank order, and by local expert within each
    sender's run), each row's local expert id [M], and the state :func:`combine` needs."""
    k, world = ids.shape[1], group.world
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, hence by owner rank
    per_expert = torch.bincount(flat, minlength=experts_per_rank * world)
    split = [experts_per_rank] * world
    arrived = group.all_to_all(per_expert, split, split, "all_to_all_counts", site)
    arrived = arrived.view(world, experts_per_rank)  # [sender, my local expert]
    send = per_expert.view(world, experts_per_rank).sum(1).tolist()
    recv = arrived.sum(1).tolist()
    token_of = order // k
    rows = group.all_to_all(x.index_select(0, token_of), send, recv, "all_to_all_dispatch",
                            site)
    local = torch.arange(experts_per_rank, device=x.device).repeat(world)
    local_ids = torch.repeat_interleave(local, arrived.reshape(-1).to(x.device))
    return rows, local_ids, Dispatched(token_of, weights.reshape(-1)[order].float(), send, recv)


def combine(group: TPGroup, y: torch.Tensor, d: Dispatched, num_tokens: int,
            site: str = "") -> torch.Tensor:
    """Return every expert output [M,H] to the rank that sent its row (the reverse split) and
    sum each token's k slots, weighted, in float32: [num_tokens, H]."""
    back = group.all_to_all(y, d.recv, d.send, "all_to_all_combine", site)
    out = torch.zeros(num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    out.index_add_(0, d.token_of, back.float() * d.weights[:, None])
    return out


class ExpertParallelMoE(SparseMoeBlock):
    """An MoE layer on an expert-parallel rank: the whole router, this rank's experts only
    (``experts`` holds ``plan.experts_per_rank`` of them, ``first_expert`` the first's global
    index), and the dispatch / combine around the same ``fused_experts`` seam."""

    def __init__(self, config: ModelConfig, layer_idx: int, plan: ShardPlan,
                 group: TPGroup) -> None:
        super().__init__(config, layer_idx)
        self.group = group
        self.first_expert, stop = plan.expert_range
        self.num_experts = config.num_experts
        self.experts = Experts(stop - self.first_expert, config.hidden_size,
                               config.expert_intermediate_size)
        self.site = f"layer {layer_idx} moe"

    def foreign_tensors(self, prefix: str) -> set[str]:
        """The on-disk names of the experts other ranks hold (this rank never reads them)."""
        mine = range(self.first_expert, self.first_expert + self.experts.num_experts)
        return {n for e in range(self.num_experts) if e not in mine
                for n in self.expert_tensor_names(prefix, e)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rows = token_split(x.shape[0], self.group.world)
        start = sum(rows[: self.group.rank])
        mine = x[start: start + rows[self.group.rank]]
        logits, weights, ids = self.route(mine)
        self.last_routing = RoutingRecord(logits, ids)  # this rank's share of the tokens
        arrived, local_ids, d = dispatch(self.group, mine, weights, ids,
                                         self.experts.num_experts, self.site)
        y = self._run_experts(arrived, local_ids)
        out = combine(self.group, y, d, mine.shape[0], self.site).to(x.dtype)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(mine)) * self.shared_expert(mine)
        return self.group.all_gather_rows(out, rows, self.site).view(shape)

    def _run_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each arrived row through its (local) expert, weight 1: the sender weights it."""
        if rows.shape[0] == 0:
            return rows
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self.fused_experts(rows, self.experts.gate_up_proj, self.experts.down_proj,
                                  ones, local_ids[:, None])
