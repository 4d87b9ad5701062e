import pytest
import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


def make_tiny(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(ModelConfig(**{**TINY, **kw})).eval()


@pytest.fixture
def make_tiny_model():
    return make_tiny


@pytest.fixture
def tiny():
    return make_tiny()


@pytest.fixture
def calib_tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (8, 32), generator=g)
