"""Fixtures of the quantization tests; and, where torch's fused bf16 CPU attention is broken
on this machine, third-party models (transformers inside gptqmodel, autoawq) attend with the
math kernel, as labkit's own model does (:func:`labkit.model.llama.sdpa`)."""

import pytest
import torch
import torch.nn.functional as F

from labkit.model.testing import tiny_model as make_tiny


def _fused_bf16_cpu_attention_fails() -> bool:
    """torch 2.13 on an AMX CPU under ``ATEN_CPU_CAPABILITY=avx2`` (how CI runs another CPU's
    kernels): the fused bf16 kernel raises "pack_vnni2 is only supported when avx512 is
    supported" for 64+ tokens."""
    q = torch.zeros(1, 1, 64, 32, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        if "pack_vnni" in str(e):
            return True
        raise
    return False


@pytest.fixture(autouse=True, scope="session")
def _math_attention_where_the_fused_kernel_fails():
    if not _fused_bf16_cpu_attention_fails():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


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
