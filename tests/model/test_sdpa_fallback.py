"""``labkit.model.llama.sdpa``: torch 2.13's fused bf16 CPU attention raises on AMX machines
under ``ATEN_CPU_CAPABILITY=avx2`` (``pack_vnni2``); the model then runs PyTorch's math kernel
for that dtype, and any other error still propagates. The failure is simulated here, so the test
runs on every CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from labkit.model import llama


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    return q, k, v, torch.ones(70, 70, dtype=torch.bool).tril()


def test_a_pack_vnni_failure_falls_back_to_the_math_kernel_for_that_dtype(monkeypatch):
    q, k, v, mask = _inputs()
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    real, calls = F.scaled_dot_product_attention, []

    def flaky(*args, **kw):  # the fused kernel's failure, once; then the real function
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", flaky)
    monkeypatch.setattr(llama, "_FUSED_CPU_KERNEL_FAILS", set())
    got = llama.sdpa(q, k, v, mask, None)
    assert torch.equal(got, want) and llama._FUSED_CPU_KERNEL_FAILS == {torch.bfloat16}
    llama.sdpa(q, k, v, mask, None)  # decided once: no second try of the fused kernel
    assert len(calls) == 3


def test_other_attention_errors_propagate(monkeypatch):
    q, k, v, mask = _inputs()

    def broken(*args, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    monkeypatch.setattr(llama, "_FUSED_CPU_KERNEL_FAILS", set())
    with pytest.raises(RuntimeError, match="shape mismatch"):
        llama.sdpa(q, k, v, mask, None)
    assert llama._FUSED_CPU_KERNEL_FAILS == set()
