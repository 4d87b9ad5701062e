"""Shared test set-up: CPU-friendly threads, the Triton interpreter when there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
