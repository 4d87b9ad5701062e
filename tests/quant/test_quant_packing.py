"""GPTQ / AWQ bit layouts against per-element Python bit arithmetic and the kernels' own
reference unpackers (written independently in labkit.kernels.dequant_matmul)."""

import pytest
import torch

from labkit.quant import QuantizationError, quantize_rtn
from labkit.quant.packing import (
    AWQ_ORDER,
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq,
    unpack_awq,
    unpack_gptq,
)


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _quant(N=16, K=64, gs=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(N, K, generator=g), 4, gs)


def test_gptq_layout_bit_by_bit():
    q = _quant()
    qweight, qzeros = pack_gptq(q.codes, q.zeros)
    N, K = q.codes.shape
    assert qweight.dtype == torch.int32 and qweight.shape == (K // 8, N)
    assert qzeros.shape == (K // 32, N // 8)
    for r in range(K // 8):
        for n in range(N):
            word = sum(int(q.codes[n, 8 * r + j]) << (4 * j) for j in range(8))
            assert _u32(int(qweight[r, n])) == word  # lowest nibble = first input row
    for g in range(K // 32):
        for c in range(N // 8):
            word = sum((int(q.zeros[g, 8 * c + j]) - 1) << (4 * j) for j in range(8))
            assert _u32(int(qzeros[g, c])) == word  # zero - 1
    codes, zeros = unpack_gptq(qweight, qzeros)
    assert torch.equal(codes, q.codes.int()) and torch.equal(zeros, q.zeros)


def test_awq_layout_bit_by_bit():
    q = _quant(seed=1)
    qweight, qzeros = pack_awq(q.codes, q.zeros)
    N, K = q.codes.shape
    assert qweight.shape == (K, N // 8) and qzeros.shape == (K // 32, N // 8)
    for k in range(K):
        for c in range(N // 8):
            word = sum(int(q.codes[8 * c + AWQ_ORDER[j], k]) << (4 * j) for j in range(8))
            assert _u32(int(qweight[k, c])) == word
    for g in range(K // 32):
        for c in range(N // 8):
            word = sum(int(q.zeros[g, 8 * c + AWQ_ORDER[j]]) << (4 * j) for j in range(8))
            assert _u32(int(qzeros[g, c])) == word  # raw zeros
    codes, zeros = unpack_awq(qweight, qzeros)
    assert torch.equal(codes, q.codes.int()) and torch.equal(zeros, q.zeros)


def test_dequant_agrees_with_kernel_reference_unpackers():
    dm = pytest.importorskip("labkit.kernels.dequant_matmul", reason="kernels not available")
    q = _quant(N=32, K=128, gs=64, seed=2)
    scales = q.scales.half()
    qw, qz = pack_gptq(q.codes, q.zeros)
    ref = dm.gptq_dequantize_ref(qw, qz, scales.float(), q.g_idx).T  # kernels use W as [K, N]
    torch.testing.assert_close(dequantize_gptq(qw, qz, scales, q.g_idx), ref)
    torch.testing.assert_close(ref, q.dequantize())
    qw, qz = pack_awq(q.codes, q.zeros)
    ref = dm.awq_dequantize_ref(qw, qz, scales.float(), 64).T
    torch.testing.assert_close(dequantize_awq(qw, qz, scales, 64), ref)


def test_gptq_v1_cannot_store_zero_point_zero():
    q = _quant()
    q.zeros[0, 0] = 0
    with pytest.raises(QuantizationError, match="zero point 0"):
        pack_gptq(q.codes, q.zeros)


def test_pack_rejects_bad_shapes():
    q = _quant(N=12)
    with pytest.raises(QuantizationError, match="divisible by 8"):
        pack_awq(q.codes, q.zeros)
