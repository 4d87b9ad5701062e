"""The seeded tiny random model: a real Llama-family network small enough to run anywhere.

Tests, exercise checkers and notebooks need a model whose outputs are reproducible and that
needs no checkpoint: a 2-layer, 64-wide decoder with grouped-query attention (4 query heads
share 2 KV heads) and a 128-token vocabulary. Its weights are random, so its text is noise, but
every engine path must still reproduce ``generate`` token for token on it, which is what the
checks compare. One factory, so every caller means the same model by "the tiny model".
"""

from __future__ import annotations

import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


def tiny_config(**overrides) -> ModelConfig:
    """The tiny model's config; ``overrides`` change any field (e.g. ``sliding_window=6``)."""
    return ModelConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """The tiny model in eval mode, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()
