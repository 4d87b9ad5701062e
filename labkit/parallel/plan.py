"""Which slice of every weight a tensor-parallel rank owns (Megatron-style, as vLLM does it).

A decoder layer has two matmul pairs, and each pair needs only one all-reduce if the first matmul
is split by output columns and the second by input rows:

    attention: q/k/v column-parallel (whole heads per rank) -> o_proj row-parallel -> all-reduce
    MLP:     gate/up column-parallel (channels per rank)   -> down_proj row-parallel -> all-reduce

So a rank's shard is an ordinary Llama with fewer heads and a narrower MLP: ``shard_config``
returns that smaller ``ModelConfig``, and the same model code runs on every rank. Grouped-query
attention limits the split: KV heads are divided between ranks while there are enough of them;
with fewer KV heads than ranks each rank keeps a *copy* of the one KV head its query heads read
(vLLM replicates them the same way), so the KV cache per rank stops shrinking.

The embedding and the LM head are split by vocabulary rows: each rank looks up (or scores) only
its slice of the vocabulary, then an all-reduce (embedding) or all-gather (logits) completes it.

A mixture-of-experts layer is not sliced: with ``enable_expert_parallel`` its experts are
*placed*, E/N whole experts per rank (``ShardPlan.expert_range``), and the tokens travel to them
(:mod:`labkit.parallel.expert`); without the flag an MoE model is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.errors import EngineConfigError, MoEUnsupportedError
from labkit.model.config import ModelConfig
from labkit.model.config_sliding import refuse_family
from labkit.model.mla import refuse_mla


class TensorParallelError(EngineConfigError):
    """A model that cannot be split over this many ranks; the message says which count."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world``: the head, channel and vocabulary ranges it owns."""

    rank: int
    world: int
    num_heads: int           # query heads on this rank
    num_kv_heads: int        # KV heads on this rank (1 when replicated)
    kv_head_start: int       # first KV head of the full model this rank holds
    intermediate: int        # MLP channels on this rank
    vocab_per_rank: int      # rows of the (padded) vocabulary per rank
    vocab_size: int          # the full vocabulary
    head_dim: int
    kv_replicas: int = 1     # ranks holding a copy of the same KV head
    experts_per_rank: int = 0  # expert parallelism: whole experts on each rank (0: not used)

    @property
    def q_rows(self) -> tuple[int, int]:
        a = self.rank * self.num_heads * self.head_dim
        return a, a + self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        a = self.kv_head_start * self.head_dim
        return a, a + self.num_kv_heads * self.head_dim

    @property
    def mlp_rows(self) -> tuple[int, int]:
        return self.rank * self.intermediate, (self.rank + 1) * self.intermediate

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """This rank's vocabulary rows, clipped to the real vocabulary (the last may be short)."""
        a = min(self.rank * self.vocab_per_rank, self.vocab_size)
        return a, min(a + self.vocab_per_rank, self.vocab_size)

    @property
    def expert_range(self) -> tuple[int, int]:
        """The experts this rank holds, [start, stop) of every MoE layer's E."""
        return self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank

    @property
    def kv_replicated(self) -> bool:
        """True when several ranks hold a copy of the same KV head (KV heads < ranks)."""
        return self.kv_replicas > 1


def _experts_per_rank(config: ModelConfig, world: int, expert_parallel: bool) -> int:
    """E/N, or 0 without expert parallelism; refuses what cannot be placed, by name."""
    moe = getattr(config, "moe_layers", [])
    if not expert_parallel:
        if moe:
            err = MoEUnsupportedError("tensor parallelism", config.architecture, moe)
            err.args = (f"tensor parallelism slices dense MLPs only: this {config.architecture} "
                        f"has sparse MoE MLPs in layers {moe}. Pass enable_expert_parallel=True "
                        "(--enable-expert-parallel) to place whole experts on the ranks "
                        "instead (labkit.parallel.expert)",)
            raise err
        return 0
    if not moe:
        raise TensorParallelError(
            f"enable_expert_parallel places the experts of MoE layers on ranks, but this "
            f"{config.architecture} has no MoE layers: drop the flag (tensor parallelism alone "
            "splits a dense model)")
    if config.num_experts % world:
        raise TensorParallelError(
            f"num_experts {config.num_experts} is not divisible by tensor_parallel_size {world}: "
            f"expert parallelism places num_experts / {world} whole experts on each rank; use "
            f"a size that divides {config.num_experts}")
    return config.num_experts // world


def make_plan(config: ModelConfig, world: int, rank: int,
              expert_parallel: bool = False) -> ShardPlan:
    """The shard of ``rank``; raises TensorParallelError naming the count that does not divide.
    Dense MLPs are sliced; an MoE model needs ``expert_parallel`` (its experts are placed
    whole), else it raises MoEUnsupportedError."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    if not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is outside 0..{world - 1}")
    refuse_mla(config, "tensor parallelism")  # the shard plan slices q/k/v_proj by heads
    refuse_family(config, "tensor parallelism")  # sinks / Gemma's norms are not in the plan
    per_rank = _experts_per_rank(config, world, expert_parallel)
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hq % world:
        raise TensorParallelError(
            f"num_attention_heads {hq} is not divisible by tensor_parallel_size {world}; "
            f"use a size that divides {hq}")
    dense = [i for i in range(config.num_hidden_layers) if i not in
             getattr(config, "moe_layers", [])]
    if dense and config.intermediate_size % world:  # the dense MLPs are sliced
        raise TensorParallelError(
            f"intermediate_size {config.intermediate_size} is not divisible by "
            f"tensor_parallel_size {world}")
    if hkv >= world:
        if hkv % world:
            raise TensorParallelError(
                f"num_key_value_heads {hkv} is not divisible by tensor_parallel_size {world}")
        n_kv, kv_start, replicas = hkv // world, rank * (hkv // world), 1
    else:
        if world % hkv:
            raise TensorParallelError(
                f"tensor_parallel_size {world} is not a multiple of num_key_value_heads {hkv}: "
                "with fewer KV heads than ranks each KV head is copied to world/kv ranks")
        replicas = world // hkv
        n_kv, kv_start = 1, rank // replicas
    return ShardPlan(rank=rank, world=world, num_heads=hq // world, num_kv_heads=n_kv,
                     kv_head_start=kv_start, intermediate=config.intermediate_size // world,
                     vocab_per_rank=_cdiv(config.vocab_size, world),
                     vocab_size=config.vocab_size, head_dim=config.head_dim,
                     kv_replicas=replicas, experts_per_rank=per_rank)


def shard_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of the ordinary Llama that holds this rank's shard (full vocabulary kept:
    prompt validation and sampling read it; the parallel embedding and head replace the
    modules that would otherwise hold the whole vocabulary). The experts keep their width
    (``moe_intermediate_size`` pinned: Mixtral's defaults to ``intermediate_size``) and the
    router all E outputs; :mod:`labkit.parallel.expert` keeps only this rank's experts."""
    moe = {}
    if getattr(config, "moe_layers", []):
        moe = dict(moe_intermediate_size=config.expert_intermediate_size)
    return dataclasses.replace(config, num_attention_heads=plan.num_heads,
                               num_key_value_heads=plan.num_kv_heads,
                               intermediate_size=plan.intermediate, head_dim=config.head_dim,
                               extra=dict(config.extra), **moe)
