import pytest

from .synthetic import build_trace, reference_replay


@pytest.fixture
def trace():
    return build_trace()


@pytest.fixture
def ref_replay():
    return reference_replay
