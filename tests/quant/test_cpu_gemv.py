"""labkit's prefetching INT8 GEMV (labkit.quant.cpu_gemv) against the reference
dequantize-then-matmul, and the INT8 layer's choice of path.

The C kernel keeps activations, scales and accumulation in fp32, so it matches the reference to
fp32 rounding (|y - y_ref| <= 1e-5 max|y_ref|), a bound torch's bf16-activation kernel misses by
two orders of magnitude: that is how the tests see which path ran."""

import pytest
import torch

from labkit.quant import cpu_gemv
from labkit.quant.linear import W8A16Linear, use_cpu_packed
from labkit.quant.rtn import quantize_int8

LIB = cpu_gemv.library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler / AVX2 here: torch's kernel")


def _layer(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return W8A16Linear(*quantize_int8(torch.randn(n, k, generator=g) * 0.05),
                       bias=torch.randn(n, generator=g))


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(layer, x):
    with use_cpu_packed(False):
        ref = layer(x)
    return float((layer(x) - ref).abs().max() / ref.abs().max())


@needs_lib
@pytest.mark.parametrize("n,k,rows", [(64, 256, 1), (64, 256, 8), (6, 48, 3), (100, 1024, 1)])
def test_gemv_equals_dequantize_matmul_in_fp32(n, k, rows):
    assert _rel_err(_layer(n, k), _x(rows, k)) <= 1e-5


@needs_lib
def test_any_shape_through_the_kernel_itself():
    """Tails: N not a multiple of 4, K not a multiple of the vector width."""
    for n, k in ((7, 40), (1, 3), (5, 17)):
        q, s = quantize_int8(torch.randn(n, k) * 0.05)
        x = _x(2, k)
        y = cpu_gemv.int8_gemv(x, q, s.float().contiguous(), LIB)
        torch.testing.assert_close(y, x @ (q.float() * s.float()[:, None]).T, rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="features"):
        cpu_gemv.int8_gemv(_x(1, 8), q, s.float(), LIB)


@needs_lib
def test_wrong_scales_are_caught():
    """Negative control: scales off by 1% (much less than a quantization step) fail the bound."""
    q, s = quantize_int8(torch.randn(64, 256) * 0.05)
    x = _x(1, 256)
    ref = x @ (q.float() * s.float()[:, None]).T
    y = cpu_gemv.int8_gemv(x, q, (s.float() * 1.01).contiguous(), LIB)
    assert (y - ref).abs().max() > 1e-5 * ref.abs().max()


def test_prefill_rows_take_torch_kernel():
    err = _rel_err(_layer(64, 256), _x(cpu_gemv.MAX_ROWS + 1, 256))
    assert err <= 1e-2 and (LIB is None or err > 1e-5)  # bf16 rounding shows


def test_in_features_not_multiple_of_16_dequantizes():
    """torch 2.13's _weight_int8pack_mm returns garbage (1 row) or crashes (more) for such K."""
    layer = _layer(32, 200)
    assert layer.cpu_pack() is None
    assert _rel_err(layer, _x(5, 200)) == 0.0


def test_switch_off(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_STATE", {})
    monkeypatch.setenv("LABKIT_CPU_GEMV", "0")
    assert cpu_gemv.library() is None
    err = _rel_err(_layer(64, 256), _x(1, 256))
    assert 1e-6 < err <= 1e-2  # torch's bf16 path
