"""The kernel tests build CPU tensors and run the kernels through Triton's interpreter (set by
tests/conftest.py when there is no GPU). On a CUDA machine without TRITON_INTERPRET they are
skipped: there ``labkit bench kernels`` checks every kernel against its reference at real sizes.
The sm_90 compile test runs everywhere."""

import os

import pytest
import torch

_CPU_ONLY = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def pytest_collection_modifyitems(config, items):
    if not _CPU_ONLY:
        return
    skip = pytest.mark.skip(reason="interpreter tests on CPU tensors; on a GPU run "
                                   "`labkit bench kernels` (or set TRITON_INTERPRET=1)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "compile_sm90" not in str(item.fspath):
            item.add_marker(skip)
