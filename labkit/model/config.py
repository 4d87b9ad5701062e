"""ModelConfig: the handful of numbers that define a Llama-family decoder.

Llama, Qwen2 and Mistral share one architecture (pre-norm RMSNorm, rotary position embeddings,
grouped-query attention, SwiGLU MLP). They differ only in a few switches, which this dataclass
names with Hugging Face's config.json keys so a learner can read a real checkpoint's config and
see exactly what labkit will build.

Per-layer choices (which attention, how far back it sees, which MLP) come from
:meth:`ModelConfig.layer_spec`; :mod:`labkit.model.layers` builds each layer from it. Sliding
windows follow Hugging Face: ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per
layer, as Gemma 3, gpt-oss and recent Qwen2 configs carry) says which layers slide, and
``sliding_window`` how far; without ``layer_types`` a window means every layer (Mistral).

Mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) is a per-layer choice too: ``num_experts > 0``
makes layer i sparse (``LayerSpec.mlp == "moe"``, built by :mod:`labkit.model.moe`) when
``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``, as transformers'
Qwen2-MoE decides it; the others keep the dense SwiGLU of width ``intermediate_size``.

DeepSeek-V3 adds three fields (``rope_scaling``: YaRN; ``mla``: every layer's attention is
``"mla"``; ``deepseek_moe``: its MoE layers are ``"deepseek_moe"``), read from its config.json by
:mod:`labkit.model.deepseek_config`; the other families' MoE keys are in
:mod:`labkit.model.config_moe`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from labkit.errors import ConfigError
from labkit.model.config_moe import MOE_ARCHITECTURES, moe_fields, moe_hf_keys
from labkit.model.config_sliding import SLIDING_ARCHITECTURES, family_fields

if TYPE_CHECKING:
    from labkit.model.config_sliding import Gemma3Config, GptOssConfig
    from labkit.model.deepseek_config import DeepseekMoEConfig, MLAConfig

__all__ = ["MOE_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "ConfigError", "LayerSpec",
           "ModelConfig"]

LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names, per layer
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                           *MOE_ARCHITECTURES, "Gemma3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss",
                "Gemma3ForCausalLM": "gemma3_text"}
# biases on q, k, v only, never on o_proj
_QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class LayerSpec:
    """What decoder layer i is built from (:mod:`labkit.model.layers` maps the names to modules).

    ``attention``: ``"full"`` or ``"sliding"`` (a query sees only the last ``sliding_window``
    positions, itself included); ``mlp``: ``"dense"`` (SwiGLU) or ``"moe"`` (a router and
    ``num_experts`` SwiGLU experts, :mod:`labkit.model.moe`). Later kinds (``"mla"``) are new
    names here and new registry entries there, never an engine branch."""

    attention: str = "full"
    sliding_window: int | None = None
    mlp: str = "dense"


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2 always does)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None  # a sliding layer's query sees this many positions
    # per layer "full_attention" | "sliding_attention"; None: every layer slides if
    # sliding_window is set (Mistral), else none does
    layer_types: list[str] | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    # mixture of experts: 0 experts = every MLP dense. Each token's router picks
    # num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size
    # (None: intermediate_size, as Mixtral has it), weighted by their softmax probabilities,
    # renormalised over the chosen ones iff norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on, sigmoid-gated expert
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 ...
    mlp_only_layers: list[int] | None = None  # ... and i is not listed here
    # DeepSeek-V3 (labkit.model.deepseek_config): YaRN rope, latent attention, DeepSeekMoE
    rope_scaling: dict[str, Any] | None = None  # only YaRN (labkit.model.rope), else None
    mla: MLAConfig | None = None  # every layer's attention is "mla" (labkit.model.mla)
    deepseek_moe: DeepseekMoEConfig | None = None  # MoE layers are "deepseek_moe"
    # gpt-oss and Gemma 3 (labkit.model.config_sliding)
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss, model/sinks.py)
    gpt_oss: GptOssConfig | None = None  # MoE layers are "gpt_oss_moe" (clamped SwiGLU)
    gemma3: Gemma3Config | None = None  # Gemma 3's decoder (labkit.model.gemma3)
    architecture: str = "LlamaForCausalLM"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self._check_layer_types()
        self._check_moe()
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; "
                              f"labkit builds {', '.join(SUPPORTED_ARCHITECTURES)}")

    def _check_layer_types(self) -> None:
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"config field 'sliding_window' must be a positive integer or "
                              f"null, got {w!r}")
        if self.layer_types is None:
            return
        lt = self.layer_types = list(self.layer_types)
        if len(lt) != self.num_hidden_layers:
            raise ConfigError(f"config field 'layer_types' has {len(lt)} entries for "
                              f"{self.num_hidden_layers} layers (num_hidden_layers)")
        bad = sorted({t for t in lt if t not in LAYER_TYPES}, key=str)
        if bad:
            raise ConfigError(f"config field 'layer_types' holds {bad!r}; labkit builds "
                              f"{', '.join(LAYER_TYPES)}")
        if "sliding_attention" in lt and w is None:
            raise ConfigError("config field 'layer_types' names sliding_attention layers but "
                              "'sliding_window' is null: set the window")

    def _check_moe(self) -> None:
        self.mlp_only_layers = sorted(self.mlp_only_layers or [])
        e, k = self.num_experts, self.num_experts_per_tok
        if not isinstance(e, int) or e < 0:
            raise ConfigError(f"config field 'num_experts' must be >= 0, got {e!r}")
        if e and self.architecture not in MOE_ARCHITECTURES:
            raise ConfigError(f"num_experts = {e} needs a mixture-of-experts architecture "
                              f"({', '.join(MOE_ARCHITECTURES)}), not {self.architecture}")
        if self.qk_norm != (self.architecture in ("Qwen3MoeForCausalLM", "Gemma3ForCausalLM")):
            raise ConfigError("qk_norm comes with Qwen3MoeForCausalLM and Gemma3ForCausalLM "
                              "and only with them")
        if e == 0:
            return
        checks = {"num_experts_per_tok": isinstance(k, int) and 1 <= k <= e,
                  "moe_intermediate_size": self.expert_intermediate_size >= 1,
                  "decoder_sparse_step": self.decoder_sparse_step >= 1,
                  "shared_expert_intermediate_size": self.shared_expert_intermediate_size >= 0,
                  "mlp_only_layers": all(0 <= i < self.num_hidden_layers
                                         for i in self.mlp_only_layers)}
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"config field {name!r} = {getattr(self, name)!r} is out of "
                                  f"range for {e} experts and {self.num_hidden_layers} layers")

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's width: ``moe_intermediate_size``, or the dense width when unset (Mixtral;
        a property, so ``dataclasses.replace`` of ``intermediate_size`` cannot leave it stale)."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is sparse (transformers' Qwen2-MoE rule)."""
        return (self.num_experts > 0 and (layer_idx + 1) % self.decoder_sparse_step == 0
                and layer_idx not in self.mlp_only_layers)

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts (empty for a dense model)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def layer_spec(self, layer_idx: int) -> LayerSpec:
        """What layer ``layer_idx`` is: the one place the model, the KV caches and the attention
        backends learn a layer's attention kind and window from."""
        if not 0 <= layer_idx < self.num_hidden_layers:
            raise IndexError(f"layer {layer_idx} of a {self.num_hidden_layers}-layer model")
        slides = self.sliding_window is not None and (
            self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention")
        moe = "deepseek_moe" if self.deepseek_moe else "gpt_oss_moe" if self.gpt_oss else "moe"
        mlp = moe if self.is_moe_layer(layer_idx) else "dense"
        if slides:
            return LayerSpec(attention="sliding", sliding_window=self.sliding_window, mlp=mlp)
        return LayerSpec(attention="mla" if self.mla else "full", mlp=mlp)

    def layer_specs(self) -> list[LayerSpec]:
        return [self.layer_spec(i) for i in range(self.num_hidden_layers)]

    @property
    def uses_sliding_window(self) -> bool:
        """Some layer slides (the components that cannot express windows refuse such models)."""
        return any(s.sliding_window is not None for s in self.layer_specs())

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.architecture not in _QKV_BIAS_ONLY

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (e,)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count, computed from the shapes (embedding counted once if tied).

        ``active``: only the parameters one token uses (num_experts_per_tok of the experts of
        each MoE layer), the number an MoE's compute per token follows."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += (h if self.o_proj_bias else 0) + (2 * d if self.qk_norm else 0)
        attn += self.num_attention_heads if self.attention_sinks else 0
        if self.mla:
            attn = self.mla.num_parameters(h, self.num_attention_heads, self.attention_bias)
        experts = self.num_experts_per_tok if active else self.num_experts
        s = self.shared_expert_intermediate_size
        moe = (experts * 3 * h * self.expert_intermediate_size + self.num_experts * h
               + (3 * h * s + h if s else 0))
        if self.deepseek_moe:
            moe += self.deepseek_moe.extra_parameters(h, self.num_experts,
                                                      self.expert_intermediate_size)
        if self.gpt_oss:  # expert biases (gate|up, down) and the router's bias
            moe += experts * (2 * self.expert_intermediate_size + h) + self.num_experts
        mlps = sum(moe if self.is_moe_layer(i) else 3 * h * self.intermediate_size
                   for i in range(self.num_hidden_layers))
        emb = self.vocab_size * h
        return (emb * (1 if self.tie_word_embeddings else 2) + mlps
                + self.num_hidden_layers * (attn + (4 if self.gemma3 else 2) * h) + h)

    # ---- Hugging Face config.json <-> ModelConfig -------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; unsupported features raise ConfigError."""
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        archs = d.get("architectures") or []
        arch = archs[0] if archs else {v: k for k, v in _MODEL_TYPES.items()}.get(
            d.get("model_type", ""), None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"config.json 'architectures' is {archs!r} (model_type "
                              f"{d.get('model_type')!r}); labkit supports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        if d.get("hidden_act", "silu") != "silu" and arch != "Gemma3ForCausalLM":
            raise ConfigError(f"config field 'hidden_act' = {d['hidden_act']!r} is not supported "
                              "(labkit implements the SwiGLU MLP with 'silu')")
        if d.get("mlp_bias"):
            raise ConfigError("config field 'mlp_bias' = true is not supported")
        rope_theta = d.get("rope_theta", 10000.0)
        for key in ("rope_scaling", "rope_parameters"):
            rp = d.get(key)
            if rp:
                rope_type = rp.get("rope_type", rp.get("type", "default"))
                if rope_type != "default" and arch not in ("DeepseekV3ForCausalLM",
                                                           *SLIDING_ARCHITECTURES):  # own rope
                    raise ConfigError(f"config field {key!r} has rope_type {rope_type!r}; labkit "
                                      "implements only the default rotary embedding")
                rope_theta = rp.get("rope_theta", rope_theta)
        sliding, layer_types = _sliding_layers(arch, d)
        bias = (True if arch == "Qwen2ForCausalLM" else bool(d.get("qkv_bias", True))
                if arch == "Qwen2MoeForCausalLM" else bool(d.get("attention_bias", False)))
        known = set(cls.__dataclass_fields__)
        return cls(**{  # the architecture's fields last: DeepSeek-V3 overrides head_dim
            **dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"), head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            attention_bias=bias, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            sliding_window=sliding, layer_types=layer_types, architecture=arch,
            extra={k: v for k, v in d.items() if k not in known}), **moe_fields(arch, d),
            **family_fields(arch, d)})

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers' AutoConfig reads back as the same model."""
        if self.mla or self.deepseek_moe:
            raise ConfigError("labkit writes no DeepSeek-V3 config.json (it loads them only)")
        if self.architecture in SLIDING_ARCHITECTURES:
            raise ConfigError(f"labkit writes no {self.architecture} config.json (it loads them "
                              "only)")
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "architecture")}
        d["architectures"] = [self.architecture]
        d["model_type"] = _MODEL_TYPES[self.architecture]
        d["hidden_act"] = "silu"
        if self.layer_types is None:
            d.pop("layer_types")
        moe_hf_keys(self, d)
        if self.architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            if self.uses_sliding_window:
                d["use_sliding_window"] = True
                d["layer_types"] = [f"{s.attention}_attention" for s in self.layer_specs()]
            else:
                d.pop("sliding_window")
        elif self.architecture == "Qwen2ForCausalLM":
            d.pop("attention_bias")
            if self.uses_sliding_window:  # Qwen2 ignores the window without the switch; with
                d["use_sliding_window"] = True  # layer_types written, max_window_layers is moot
                d["layer_types"] = [f"{s.attention}_attention" for s in self.layer_specs()]
            else:
                d.pop("sliding_window")
        elif self.architecture == "LlamaForCausalLM" and self.layer_types is None:
            d.pop("sliding_window")  # a Llama config cannot say "every layer"
        return d


def _sliding_layers(arch: str, d: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers reads them for ``arch``; (None, None) when
    no layer slides, so a model without windows looks the same however its config said so.

    Qwen2-MoE and Qwen3-MoE: no window without ``use_sliding_window``; with it, Qwen2-MoE
    slides the layers ``layer_types`` names (default: even i below ``max_window_layers``),
    Qwen3-MoE every layer. Mixtral is Mistral's rule. Qwen2 (transformers' Qwen2Config): the
    window counts only with ``use_sliding_window``; a missing ``layer_types`` slides layers
    ``i >= max_window_layers`` (default 28). Mistral: ``sliding_window`` for every layer.
    Llama has no window in transformers; labkit reads one only beside a ``layer_types`` list.
    transformers' Llama and Mistral read no ``layer_types``; labkit honours one where a config
    carries it (its own configs, which name the sliding layers), so a config without one means
    exactly what it means to transformers.
    """
    window, layer_types = d.get("sliding_window"), d.get("layer_types")
    if arch == "Qwen2MoeForCausalLM":  # transformers' Qwen2MoeConfig.__post_init__
        if not d.get("use_sliding_window"):
            return None, None
        if layer_types is None:
            first = d.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if (i + 1) % 2 and i < first
                           else "full_attention" for i in range(d["num_hidden_layers"])]
    elif arch == "Qwen3MoeForCausalLM" and not d.get("use_sliding_window"):
        window = None  # Qwen3-MoE: with the switch, every layer slides
    if arch == "Qwen2ForCausalLM":
        if not d.get("use_sliding_window"):
            window = None
        if layer_types is None and window is not None:
            first = d.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(d["num_hidden_layers"])]
    elif arch == "LlamaForCausalLM" and layer_types is None:
        window = None
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None, None
    return window, layer_types
