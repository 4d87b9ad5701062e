"""The train tests run many tiny steps: one thread avoids OpenMP spin-waits on a busy 2-core box."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
