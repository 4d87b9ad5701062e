"""DeepSeek-V3's config.json in labkit's terms: the latent attention's shape and the router's.

Two blocks of numbers make DeepSeek-V3 what it is, each its own frozen dataclass on
:class:`~labkit.model.config.ModelConfig` (``config.mla``, ``config.deepseek_moe``), named with
the config.json keys so a learner can read a real checkpoint's config beside them:

- :class:`MLAConfig` (multi-head latent attention, :mod:`labkit.model.mla`): each token's K and V
  are compressed to one ``kv_lora_rank`` latent plus one shared ``qk_rope_head_dim`` rotary key,
  and that is all the KV cache keeps (``latent_dim`` values per token and layer). Queries may be
  low-rank too (``q_lora_rank``; None = a full ``q_proj``).
- :class:`DeepseekMoEConfig` (DeepSeekMoE, :mod:`labkit.model.deepseek_moe`): sigmoid router
  scores, experts in ``n_group`` groups of which a token may use ``topk_group``, weights times
  ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts.

The layer rule is transformers': layers ``< first_k_dense_replace`` keep the dense SwiGLU,
the rest are MoE (``mlp_only_layers`` = the first k, ``decoder_sparse_step`` = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.errors import ConfigError
from labkit.model.rope import rope_type


@dataclass(frozen=True)
class MLAConfig:
    """The shapes of multi-head latent attention (config.json names)."""

    kv_lora_rank: int  # the compressed latent c_KV every head's K and V come from
    qk_nope_head_dim: int  # per head: the part of q.k without position (from the latent)
    qk_rope_head_dim: int  # the rotary part, one key shared by every head
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... (labkit.model.rope)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {v!r}")
        q = self.q_lora_rank
        if q is not None and (not isinstance(q, int) or q < 1):
            raise ConfigError(f"config field 'q_lora_rank' must be a positive integer or null, "
                              f"got {q!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for rotary embeddings, got "
                              f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token caches per layer: the latent and the rotary key (576 in V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_parameters(self, hidden: int, heads: int, bias: bool) -> int:
        """One MLA layer's parameters (projections and the two latent RMSNorms)."""
        q = self.q_lora_rank
        qk = heads * self.qk_head_dim
        q_params = hidden * qk if q is None else hidden * q + q + q * qk + (q if bias else 0)
        kv_a = hidden * self.latent_dim + (self.latent_dim if bias else 0) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q_params + kv_a + kv_b + heads * self.v_head_dim * hidden + (hidden if bias else 0)


@dataclass(frozen=True)
class DeepseekMoEConfig:
    """DeepSeekMoE's routing and shared experts (config.json names)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int

    def extra_parameters(self, hidden: int, num_experts: int, inter: int) -> int:
        """Beyond the routed experts and the router: the selection bias, the shared experts."""
        return num_experts + 3 * hidden * inter * self.n_shared_experts


_V3 = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
       "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_group": 8,
       "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
       "moe_intermediate_size": 2048, "n_shared_experts": 1, "routed_scaling_factor": 2.5}


def deepseek_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 config.json (transformers' defaults for absent keys).

    Overrides two generic fields: ``head_dim`` is the rotary width (what the model-level rope
    turns), and ``num_key_value_heads`` equals the query heads (each head expands its own K/V
    from the one latent; the cache never stores heads, :mod:`labkit.model.mla`)."""
    g = {k: d.get(k, v) for k, v in _V3.items()}
    _refuse_unsupported(d)
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    mla = MLAConfig(g["kv_lora_rank"], g["qk_nope_head_dim"], g["qk_rope_head_dim"],
                    g["v_head_dim"], g["q_lora_rank"], bool(d.get("rope_interleave", True)))
    moe = DeepseekMoEConfig(g["n_group"] or 1, g["topk_group"] or 1,
                            float(g["routed_scaling_factor"]), g["n_shared_experts"] or 0)
    E, k = g["n_routed_experts"], g["num_experts_per_tok"]
    if E < 1 or E % moe.n_group or E // moe.n_group < 2 or not 1 <= moe.topk_group <= moe.n_group:
        raise ConfigError(f"n_routed_experts = {E} in n_group = {moe.n_group} groups of at least "
                          f"2, topk_group = {moe.topk_group} of them: not a valid grouping")
    if not isinstance(k, int) or not 1 <= k <= moe.topk_group * (E // moe.n_group):
        raise ConfigError(f"num_experts_per_tok = {k!r} is more experts than topk_group = "
                          f"{moe.topk_group} groups of {E // moe.n_group} hold")
    return dict(num_key_value_heads=d["num_attention_heads"], head_dim=mla.qk_rope_head_dim,
                rope_scaling=dict(rope) if rope_type(rope) == "yarn" else None, mla=mla,
                deepseek_moe=moe, num_experts=E, num_experts_per_tok=k,
                moe_intermediate_size=g["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                mlp_only_layers=list(range(min(g["first_k_dense_replace"] or 0,
                                               d["num_hidden_layers"]))))


def _refuse_unsupported(d: dict[str, Any]) -> None:
    """Keys of DeepSeek's own config.json that would change the model labkit builds."""
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config field 'scoring_func' = {d['scoring_func']!r}: labkit builds "
                          "DeepSeek-V3's sigmoid router only")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"config field 'topk_method' = {d['topk_method']!r}: labkit builds "
                          "DeepSeek-V3's 'noaux_tc' (bias-corrected group-limited) routing only")
    if d.get("moe_layer_freq", 1) != 1:
        raise ConfigError("config field 'moe_layer_freq' != 1 is not supported (transformers' "
                          "DeepSeek-V3 makes every layer from first_k_dense_replace on MoE)")
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if rope_type(rope) not in ("default", "yarn"):
        raise ConfigError(f"rope type {rope_type(rope)!r}: labkit's DeepSeek-V3 implements the "
                          "default rotary embedding and YaRN")
