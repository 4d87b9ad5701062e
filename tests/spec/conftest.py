"""Tiny random target / draft models with one vocabulary, so tests need no shipped checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.model.llama import LlamaForCausalLM
from labkit.model.testing import TINY
from labkit.model.testing import tiny_model as build

VOCAB = TINY["vocab_size"]


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always (partial acceptance)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core box are 50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return build(0)


@pytest.fixture(scope="session")
def drafts(target) -> dict[str, LlamaForCausalLM]:
    return {
        "noisy": noisy_copy(target, 0.3, seed=1),
        "small": build(2, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1),
        "self": target,
    }


@pytest.fixture(scope="session")
def build_model():
    """``build_model(seed, **config overrides)``: a fresh tiny random model."""
    return build
