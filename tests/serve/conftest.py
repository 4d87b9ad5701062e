"""Shared set-up for the serving tests: the shipped labkit-tiny model (it has a tokenizer, so
text prompts, stop strings and chat work) and a tiny random model for the engine-loop tests."""

from __future__ import annotations

import pytest
import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.model.loader import load_pretrained

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig(**TINY)).eval()


@pytest.fixture(scope="session")
def labkit_tiny():
    """(model, tokenizer) of the shipped labkit-tiny, in float32 on CPU."""
    return load_pretrained("labkit-tiny", dtype=torch.float32)
