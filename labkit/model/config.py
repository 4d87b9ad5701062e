"""ModelConfig: the handful of numbers that define a Llama-family decoder.

Llama, Qwen2 and Mistral share one architecture (pre-norm RMSNorm, rotary position embeddings,
grouped-query attention, SwiGLU MLP). They differ only in a few switches, which this dataclass
names with Hugging Face's config.json keys so a learner can read a real checkpoint's config and
see exactly what labkit will build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "MistralForCausalLM": "mistral"}


class ConfigError(ValueError):
    """A config.json labkit cannot build a model from; the message names the field."""


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
    sliding_window: int | None = None  # Mistral: attention only sees this many past tokens
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; "
                              f"labkit builds {', '.join(SUPPORTED_ARCHITECTURES)}")

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (e,)

    def num_parameters(self) -> int:
        """Parameter count, computed from the shapes (embedding counted once if tied)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += h if self.o_proj_bias else 0
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h

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
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field 'hidden_act' = {d['hidden_act']!r} is not supported "
                              "(labkit implements the SwiGLU MLP with 'silu')")
        if d.get("mlp_bias"):
            raise ConfigError("config field 'mlp_bias' = true is not supported")
        rope_theta = d.get("rope_theta", 10000.0)
        for key in ("rope_scaling", "rope_parameters"):
            rp = d.get(key)
            if rp:
                rope_type = rp.get("rope_type", rp.get("type", "default"))
                if rope_type != "default":
                    raise ConfigError(f"config field {key!r} has rope_type {rope_type!r}; labkit "
                                      "implements only the default rotary embedding")
                rope_theta = rp.get("rope_theta", rope_theta)
        sliding = None
        if arch == "MistralForCausalLM":
            sliding = d.get("sliding_window")
        elif arch == "Qwen2ForCausalLM" and d.get("use_sliding_window"):
            raise ConfigError("config field 'use_sliding_window' = true is not supported")
        bias = True if arch == "Qwen2ForCausalLM" else bool(d.get("attention_bias", False))
        known = set(cls.__dataclass_fields__)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"), head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            attention_bias=bias, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            sliding_window=sliding, architecture=arch,
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers' AutoConfig reads back as the same model."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "architecture")}
        d["architectures"] = [self.architecture]
        d["model_type"] = _MODEL_TYPES[self.architecture]
        d["hidden_act"] = "silu"
        if self.architecture != "MistralForCausalLM":
            d.pop("sliding_window")
        if self.architecture == "Qwen2ForCausalLM":
            d.pop("attention_bias")
        return d
