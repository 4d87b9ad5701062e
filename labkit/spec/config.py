"""``speculative_config``: what to draft with, checked once when the engine is built.

vLLM's shape: ``{"method": "draft_model" | "ngram", "model": "labkit-tiny-draft",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``. Every mistake
that would otherwise surface mid-generation (a draft with another vocabulary proposes token ids
that mean something else to the target; a draft with a shorter context crashes on a long prompt)
is raised here, at construction, with what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labkit.engine.validate import is_int

METHODS = ("draft_model", "ngram")


class SpeculativeConfigError(ValueError):
    """The speculative_config cannot work with this target model."""


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft: shipped name, local path, or an nn.Module (tests)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: Any = None  # the loaded draft (set by resolve)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise SpeculativeConfigError(f"speculative_config must be a dict, got {type(d)}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max",
                 "prompt_lookup_min"}
        unknown = set(d) - known
        if unknown:
            raise SpeculativeConfigError(f"unknown speculative_config keys {sorted(unknown)}; "
                                         f"valid keys: {sorted(known)}")
        method = d.get("method")
        if method is None:  # vLLM infers the method from what is given
            method = "draft_model" if d.get("model") is not None else "ngram"
        return cls(method=method, num_speculative_tokens=d.get("num_speculative_tokens", 4),
                   model=d.get("model"), prompt_lookup_max=d.get("prompt_lookup_max", 4),
                   prompt_lookup_min=d.get("prompt_lookup_min", 1))

    def resolve(self, target_config: Any, max_model_len: int | None = None,
                dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> SpeculativeConfig:
        """Validate against the target and load the draft model (if any). Returns self.

        ``max_model_len``: the longest sequence the engine allows (default: the target's
        context); the draft must reach at least that far."""
        g = self.num_speculative_tokens
        if not is_int(g) or g < 1:
            raise SpeculativeConfigError(
                f"num_speculative_tokens (γ) must be an integer >= 1, got {g!r}")
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r}; choose one of {METHODS}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (is_int(lo) and is_int(hi)) or not 1 <= lo <= hi:
                raise SpeculativeConfigError(
                    "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
            return self
        if self.model is None:
            raise SpeculativeConfigError(
                'method "draft_model" needs "model": a shipped name such as '
                '"labkit-tiny-draft", a checkpoint folder, or a model object')
        draft = self.model
        if not isinstance(draft, torch.nn.Module):
            from labkit.model.loader import load_model

            draft = load_model(draft, dtype=dtype, device=device)
        dc, tc = draft.config, target_config
        if dc.vocab_size != tc.vocab_size:
            raise SpeculativeConfigError(
                f"draft vocabulary ({dc.vocab_size} tokens) differs from the target's "
                f"({tc.vocab_size}): draft and target must share one tokenizer")
        need = max_model_len or tc.max_position_embeddings
        if dc.max_position_embeddings < need:
            raise SpeculativeConfigError(
                f"draft context ({dc.max_position_embeddings} positions) is smaller than the "
                f"target's ({need}, max_model_len): the draft could not propose for long "
                "sequences; use a draft with at least that context or lower max_model_len")
        self.draft_model = draft.eval()
        return self
