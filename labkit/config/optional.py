"""The optional parts, None unless asked for: speculative decoding, multi-LoRA, a KV connector.

Each is vLLM's config of the same name, built from the dict or flags a user gives (``from_dict``
/ ``from_kwargs``) and checked there, so a wrong key fails at construction with the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from labkit.config.parts import KV_ROLES, SPEC_METHODS
from labkit.errors import EngineConfigError, SpeculativeConfigError
from labkit.utils import check_int, is_int


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``{"method": "draft_model" | "ngram" | "eagle", "model":
    "labkit-tiny-draft-distilled", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}``. ``draft_model`` is the loaded draft (set by the engine builder,
    which checks it against the target with :meth:`check_draft`)."""

    method: str
    num_speculative_tokens: int = 4
    model: Any = None  # draft: shipped name, local path, or an nn.Module (tests)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: Any = None

    def __post_init__(self) -> None:
        g = self.num_speculative_tokens
        if not is_int(g) or g < 1:
            raise SpeculativeConfigError(
                f"num_speculative_tokens (γ) must be an integer >= 1, got {g!r}")
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r}; choose one of {SPEC_METHODS}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram" and (not (is_int(lo) and is_int(hi)) or not 1 <= lo <= hi):
            raise SpeculativeConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.method == "eagle" and self.model is None:
            raise SpeculativeConfigError(
                'method "eagle" needs "model": an EAGLE head trained for the target, such as '
                '"labkit-tiny-eagle", a head folder, or an EagleDraft object')
        if self.method == "draft_model" and self.model is None:
            raise SpeculativeConfigError(
                'method "draft_model" needs "model": a shipped name such as '
                '"labkit-tiny-draft", a checkpoint folder, or a model object')

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise SpeculativeConfigError(f"speculative_config must be a dict, got {type(d)}")
        known = {f.name for f in fields(cls)} - {"draft_model"}
        unknown = set(d) - known
        if unknown:
            raise SpeculativeConfigError(f"unknown speculative_config keys {sorted(unknown)}; "
                                         f"valid keys: {sorted(known)}")
        d = dict(d)
        if d.get("method") is None:  # vLLM infers the method from what is given
            d["method"] = "draft_model" if d.get("model") is not None else "ngram"
        return cls(**d)

    @staticmethod
    def check_draft(draft: Any, target: Any, max_model_len: int) -> None:
        """A draft with another vocabulary proposes ids that mean something else to the target;
        one with a shorter context would crash on a long prompt: both fail here, up front."""
        if draft.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's "
                f"({target.vocab_size}): draft and target must share one tokenizer")
        if draft.max_position_embeddings < max_model_len:
            raise SpeculativeConfigError(
                f"draft context ({draft.max_position_embeddings} positions) is smaller than the "
                f"target's ({max_model_len}, max_model_len): the draft could not propose for "
                "long sequences; use a draft with at least that context or lower max_model_len")


@dataclass
class LoRAConfig:
    """vLLM's ``LoRAConfig`` (``LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16,
    max_cpu_loras=8)``): at most ``max_loras`` adapters sit in the device slots at once (so one
    step mixes at most that many), up to ``max_cpu_loras`` loaded adapters wait in a CPU cache
    (LRU, :mod:`labkit.lora.manager`), and no adapter may have a rank above ``max_lora_rank``
    (the slots are allocated at that rank). ``max_cpu_loras=None`` means ``max_loras``."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise EngineConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                    f"({self.max_loras}), as vLLM asks: every adapter in a "
                                    "device slot is also in the CPU cache")

    @classmethod
    def from_kwargs(cls, enable_lora: bool, kw: dict[str, Any]) -> LoRAConfig | None:
        """Pop the LoRA settings out of ``kw``; None unless ``enable_lora``."""
        given = {k: kw.pop(k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras")
                 if k in kw}
        if not enable_lora:
            if given:
                raise EngineConfigError(f"{sorted(given)} only apply with enable_lora=True")
            return None
        return cls(**given)


@dataclass
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: ``{"kv_connector": "offloading", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes": 1 << 30, "disk_dir": "/tmp/kv",
    "disk_bytes": 8 << 30}}``. ``kv_connector`` is a registered name or a connector object
    (:mod:`labkit.kv.connector`, which builds and checks it); ``kv_role`` says whether this
    instance saves KV (producer), loads it (consumer) or both; the extra config is the
    connector's own settings. Only the shape is checked here: this module imports nothing."""

    kv_connector: Any = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector is None:
            raise EngineConfigError('kv_transfer_config needs "kv_connector": a registered name '
                                    'such as "offloading", or a connector object')
        if self.kv_role not in KV_ROLES:
            raise EngineConfigError(f"unknown kv_role {self.kv_role!r}; choose one of {KV_ROLES}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise EngineConfigError(f"kv_connector_extra_config must be a dict, got "
                                    f"{type(self.kv_connector_extra_config).__name__}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        if isinstance(d, KVTransferConfig):
            return d
        if not isinstance(d, dict):
            raise EngineConfigError(f"kv_transfer_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise EngineConfigError(f"unknown kv_transfer_config keys {sorted(unknown)}; valid: "
                                    f"{sorted(f.name for f in fields(cls))}")
        return cls(**d)
