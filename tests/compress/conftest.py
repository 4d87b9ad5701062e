import pytest
import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, tie_word_embeddings=True)


def make(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(ModelConfig(**{**TINY, **kw})).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: sharper, more varied logits
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return m


@pytest.fixture
def make_model():
    return make


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 96, (4, 33), generator=g)
