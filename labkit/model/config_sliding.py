"""The config.json of the two sliding-window families of 2026, gpt-oss and Gemma 3, in labkit's
terms (kept beside :mod:`labkit.model.config`, which calls :func:`family_fields`).

Both interleave sliding and full attention through ``layer_types`` (gpt-oss: alternating,
window 128; Gemma 3: five local layers to one global, window 512-4096), which the generic
:class:`~labkit.model.config.ModelConfig` already reads. What else they need:

- :class:`GptOssConfig` (``GptOssForCausalLM``, :mod:`labkit.model.gpt_oss`): per-head attention
  sinks (:mod:`labkit.model.sinks`), biases on q/k/v/o, YaRN rope (``rope_parameters``), and an
  MoE in every layer whose experts run a *clamped* SwiGLU (``swiglu_alpha``, ``swiglu_limit``).
- :class:`Gemma3Config` (``Gemma3ForCausalLM``, text only, :mod:`labkit.model.gemma3`): the
  query scale ``query_pre_attn_scalar^-0.5``, two rope bases (``rope_local_base_freq`` for
  sliding layers, ``rope_theta`` and an optional linear scaling for global ones), final logit
  softcapping; the rest of its shape (QK-norm, four norms per layer, gelu-tanh MLP, scaled
  embeddings) is fixed by the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.errors import ArchitectureUnsupportedError, ConfigError
from labkit.model.rope import rope_type

SLIDING_ARCHITECTURES = ("GptOssForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss's expert activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``
    with ``g = clamp(gate, max=limit)``."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class Gemma3Config:
    """What Gemma 3's text decoder adds to the generic fields (config.json names)."""

    query_pre_attn_scalar: float = 256.0
    rope_local_base_freq: float = 10000.0  # sliding layers' rope base
    rope_scaling_factor: float = 1.0  # global layers' linear position scaling (1: none)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)


def family_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss or Gemma 3 config.json ({} for other architectures)."""
    if arch == "GptOssForCausalLM":
        return _gpt_oss_fields(d)
    if arch == "Gemma3ForCausalLM":
        return _gemma3_fields(d)
    return {}


def _default_layer_types(d: dict[str, Any], every: int) -> list[str]:
    """transformers' default: layer i slides unless (i + 1) is a multiple of ``every``."""
    return d.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                    for i in range(d["num_hidden_layers"])]


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope_type(rope) not in ("default", "yarn"):
        raise ConfigError(f"rope type {rope_type(rope)!r}: labkit's gpt-oss implements the "
                          "default rotary embedding and YaRN")
    return dict(num_experts=d.get("num_local_experts", 128),
                num_experts_per_tok=d.get("num_experts_per_tok", 4),
                moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True,
                attention_sinks=True, attention_bias=bool(d.get("attention_bias", True)),
                sliding_window=d.get("sliding_window", 128),
                layer_types=_default_layer_types(d, 2),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 150000.0))),
                rope_scaling=dict(rope) if rope_type(rope) == "yarn" else None,
                gpt_oss=GptOssConfig(float(d.get("swiglu_alpha", 1.702)),
                                     float(d.get("swiglu_limit", 7.0))))


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    for key, ok in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False)):
        if d.get(key, ok) not in (ok, False):
            raise ConfigError(f"config field {key!r} = {d[key]!r} is not supported by labkit's "
                              "Gemma 3 (it builds causal attention without logit softcapping)")
    act = d.get("hidden_activation", d.get("hidden_act")) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"config field 'hidden_activation' = {act!r}: labkit's Gemma 3 "
                          "implements 'gelu_pytorch_tanh'")
    rp = d.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or d.get("rope_scaling") or {})
    local = rp.get("sliding_attention") or {}
    for name, r in (("full_attention", full), ("sliding_attention", local)):
        if rope_type(r) not in ("default", "linear"):
            raise ConfigError(f"{name} rope type {rope_type(r)!r}: labkit's Gemma 3 implements "
                              "the default rotary embedding and linear scaling")
    g = Gemma3Config(
        float(d.get("query_pre_attn_scalar", 256)),
        float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0))),
        float(full.get("factor", 1.0)) if rope_type(full) == "linear" else 1.0,
        d.get("final_logit_softcapping"))
    return dict(qk_norm=True, gemma3=g, layer_types=_default_layer_types(
                    d, d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))),
                sliding_window=d.get("sliding_window", 4096),
                rope_theta=float(full.get("rope_theta", d.get("rope_theta", 1e6))),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))


_WHY = {"GptOssForCausalLM": "per-head attention sinks and biased, interleaved MoE experts",
        "Gemma3ForCausalLM": "sandwich norms, GeGLU, scaled embeddings and per-layer rope bases"}


def refuse_family(config: object, feature: str) -> None:
    """Raise :class:`~labkit.errors.ArchitectureUnsupportedError` if ``config`` is gpt-oss's or
    Gemma 3's: the guard of features that assume Llama's layer (fused add + norm, piecewise
    compilation, tensor-parallel slicing; :func:`labkit.model.moe.refuse_moe` calls it for
    quantization, GGUF export, pruning, EAGLE and the lean draft)."""
    arch = getattr(config, "architecture", None)
    if arch in _WHY and (getattr(config, "gpt_oss", None) or getattr(config, "gemma3", None)):
        raise ArchitectureUnsupportedError(feature, arch, _WHY[arch])
