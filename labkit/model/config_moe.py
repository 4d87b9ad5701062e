"""The mixture-of-experts keys of each architecture's config.json, both ways (kept beside
:mod:`labkit.model.config`, which reads and writes config.json with them; ``c`` is a
:class:`~labkit.model.config.ModelConfig`, untyped here so the two modules import one way).

Each MoE family spells the same few numbers differently (Mixtral's ``num_local_experts``,
Qwen's ``num_experts`` and ``moe_intermediate_size``, Qwen2-MoE's shared expert, DeepSeek-V3's
``n_routed_experts`` and ``first_k_dense_replace``: :mod:`labkit.model.deepseek_config`);
:class:`~labkit.model.config.ModelConfig` holds them under one set of names.
"""

from __future__ import annotations

from typing import Any

from labkit.errors import ConfigError
from labkit.model.deepseek_config import deepseek_fields

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                     "DeepseekV3ForCausalLM", "GptOssForCausalLM")


def moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ``arch``'s config.json, with transformers' defaults where one is absent.

    Mixtral: top-``num_experts_per_tok`` of ``num_local_experts`` experts of width
    ``intermediate_size`` in every layer, always renormalised. Qwen3-MoE / Qwen2-MoE:
    ``num_experts`` (Qwen3-MoE's config.json spells it ``num_local_experts``) of width
    ``moe_intermediate_size``, ``norm_topk_prob``, the layer rule of ``decoder_sparse_step`` and
    ``mlp_only_layers``; Qwen3 adds per-head q/k RMSNorm, Qwen2-MoE a shared expert."""
    if arch not in MOE_ARCHITECTURES or arch == "GptOssForCausalLM":
        return {}  # gpt-oss: labkit.model.config_sliding reads its experts
    if arch == "DeepseekV3ForCausalLM":
        return deepseek_fields(d)
    if arch == "MixtralForCausalLM":
        return dict(num_experts=d.get("num_local_experts", 8),
                    num_experts_per_tok=d.get("num_experts_per_tok", 2), norm_topk_prob=True)
    qwen3 = arch == "Qwen3MoeForCausalLM"
    defaults = (128, 8, 768) if qwen3 else (60, 4, 1408)
    out = dict(num_experts=d.get("num_experts", d.get("num_local_experts", defaults[0])),
               num_experts_per_tok=d.get("num_experts_per_tok", defaults[1]),
               moe_intermediate_size=d.get("moe_intermediate_size", defaults[2]),
               norm_topk_prob=bool(d.get("norm_topk_prob", False)),
               decoder_sparse_step=d.get("decoder_sparse_step", 1),
               mlp_only_layers=list(d.get("mlp_only_layers") or []), qk_norm=qwen3)
    if not qwen3:
        out["shared_expert_intermediate_size"] = d.get("shared_expert_intermediate_size", 5632)
    return out


def moe_hf_keys(c: Any, d: dict[str, Any]) -> None:
    """Write ``c``'s MoE fields into config.json dict ``d`` under ``c.architecture``'s names."""
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                "qk_norm")
    vals = {k: d.pop(k) for k in moe_keys}
    if c.architecture == "MixtralForCausalLM":
        if (c.expert_intermediate_size != c.intermediate_size or c.shared_expert_intermediate_size
                or c.decoder_sparse_step != 1 or c.mlp_only_layers or not c.norm_topk_prob):
            raise ConfigError("a Mixtral config.json cannot say this MoE layout (experts as wide "
                              "as intermediate_size, renormalised top-k, every layer sparse, no "
                              "shared expert): use Qwen2MoeForCausalLM")
        d.update(num_local_experts=vals["num_experts"],
                 num_experts_per_tok=vals["num_experts_per_tok"])
    elif c.architecture in MOE_ARCHITECTURES:
        d.update({k: vals[k] for k in moe_keys[:-1]},
                 moe_intermediate_size=c.expert_intermediate_size)
        if c.architecture == "Qwen3MoeForCausalLM":
            d.pop("shared_expert_intermediate_size")
        else:
            d["qkv_bias"] = d.pop("attention_bias")
