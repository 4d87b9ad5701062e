"""Tiny random checkpoints of each supported architecture, saved as Hugging Face folders."""

from __future__ import annotations

import pytest
import torch
from tp_fixtures import ARCHS, save_checkpoint

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{name: (folder, model)} with seeded random weights (biases random too, so they count)."""
    out = {}
    for i, (name, kw) in enumerate(ARCHS.items()):
        torch.manual_seed(i)
        model = LlamaForCausalLM(ModelConfig(**kw)).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(std=0.1)
        folder = tmp_path_factory.mktemp(name)
        save_checkpoint(model, folder)
        out[name] = (folder, model)
    return out
