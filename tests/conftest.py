"""Shared test set-up: CPU-friendly threads, the Triton interpreter when there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread per test process: the suite runs on 2 workers (pytest -n 2) on 2 cores, and
# the lab's tiny tensors gain nothing from intra-op threads.
torch.set_num_threads(1)
