"""rms_norm (with fused residual) and rotary_embedding against the model's own modules."""

import pytest
import torch
from labkit.kernels.rms_norm import rms_norm, rms_norm_ref
from labkit.kernels.rotary_embedding import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)

from labkit.model.llama import RMSNorm, apply_rope, rope_cos_sin

# 1 ulp of the dtype at |x| ~ 4 (the interpreter truncates fp32 -> bf16/fp16; a GPU rounds).
ULP = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


@pytest.mark.parametrize("shape,dtype", [((3, 5, 96), torch.float32),
                                         ((7, 128), torch.bfloat16), ((4, 100), torch.float16)])
def test_rms_norm_matches_model_module(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g).to(dtype)
    mod = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
        ref = mod(x)
    torch.testing.assert_close(rms_norm(x, mod.weight, 1e-5).float(), ref.float(),
                               atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add(dtype):
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(6, 64, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=g).to(dtype)
    y, new_res = rms_norm(x, w, 1e-6, residual=res)
    y_ref, res_ref = rms_norm_ref(x, w, 1e-6, residual=res)
    torch.testing.assert_close(new_res.float(), (x.float() + res.float()), atol=ULP[dtype],
                               rtol=0)
    torch.testing.assert_close(new_res.float(), res_ref.float(), atol=ULP[dtype], rtol=0)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=ULP[dtype], rtol=ULP[dtype])


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 2, 64, torch.float32), (8, 2, 128, torch.bfloat16),
                                            (3, 1, 48, torch.float16)])
def test_rotary_matches_model_apply_rope(hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(d)
    n, theta = 11, 10000.0
    positions = torch.randint(0, 500, (n,), generator=g)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    cos, sin = rope_cos_sin(positions[None], d, theta, torch.float32)  # the model's formula
    q_ref = apply_rope(q.float()[None], cos, sin)[0]
    k_ref = apply_rope(k.float()[None], cos, sin)[0]
    q2, k2 = rotary_embedding_ref(positions, q, k, build_cos_sin_cache(512, d, theta))
    rotary_embedding(positions, q, k, build_cos_sin_cache(512, d, theta))  # in place
    tol = 2 * ULP[dtype] if dtype != torch.float32 else 2e-5
    torch.testing.assert_close(q.float(), q_ref, atol=tol, rtol=0)
    torch.testing.assert_close(k.float(), k_ref, atol=tol, rtol=0)
    torch.testing.assert_close(q.float(), q2.float(), atol=tol, rtol=0)


def test_rotary_position_zero_is_identity_and_rejects_bad_cache():
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(2, dtype=torch.long), q, k, build_cos_sin_cache(4, 16))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    with pytest.raises(ValueError, match="head_dim"):
        rotary_embedding(torch.zeros(2, dtype=torch.long), q, k, build_cos_sin_cache(4, 8))
