import pytest
import torch

from labkit.model.testing import tiny_model as make_tiny


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
