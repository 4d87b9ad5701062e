"""A tiny random-weight model (no checkpoint needed) and its reference generations."""

from __future__ import annotations

import pytest
import torch

from labkit.model import testing
from labkit.model.generate import generate
from labkit.model.llama import LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return testing.tiny_model()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Lengths 1..40 incl. block-aligned ones, a shared 16-token prefix and a repeated prompt."""
    g = torch.Generator().manual_seed(1)
    r = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    shared = r(16)
    ps = [r(5), r(16), shared + r(7), r(1), r(33), shared + r(16), r(12)]
    ps.append(list(ps[1]))  # identical block-aligned prompt: fully cached the second time
    ps.append(shared + r(3))
    return ps


class Reference:
    """Memoised labkit.model.generate outputs (the ground truth)."""

    def __init__(self, model):
        self.model = model
        self.cache: dict = {}

    def __call__(self, prompt, max_new_tokens, **kw):
        key = (tuple(prompt), max_new_tokens, tuple(sorted(kw.items())))
        if key not in self.cache:
            self.cache[key] = generate(self.model, prompt, max_new_tokens, **kw)
        return self.cache[key]


@pytest.fixture(scope="session")
def reference(tiny_model) -> Reference:
    return Reference(tiny_model)
