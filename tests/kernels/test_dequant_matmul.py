"""Dequant-matmul kernels against hand-packed words, labkit.quant's packers and bitsandbytes."""

import pytest
import torch
from labkit.kernels import dequant_matmul as dq
from labkit.kernels.nf4 import nf4_dequantize, nf4_dequantize_ref

# Relative Frobenius error vs an fp32 matmul on the exactly dequantised weight: the kernel
# accumulates in fp32, so what remains is the fp16/bf16 rounding of the output (and of x, W).
REL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_reference_unpackers_by_hand():
    codes = [3, 14, 0, 7, 9, 1, 15, 6]
    word = sum(c << (4 * j) for j, c in enumerate(codes))
    word = word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32
    packed = torch.tensor([[word]], dtype=torch.int32)
    assert dq.unpack_int4_rows(packed)[:, 0].tolist() == codes  # GPTQ: lowest nibble first row
    awq = dq.unpack_int4_cols(packed, dq.AWQ_ORDER)[0].tolist()
    assert awq == [codes[dq.AWQ_ORDER.index(c)] for c in range(8)]  # nibble j -> col ORDER[j]
    assert awq[2] == codes[1] and awq[1] == codes[4]


def _gptq(k, n, gs, gen, act_order):
    from labkit.quant.packing import dequantize_gptq, pack_gptq

    g = k // gs
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 16, (g, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 1e-3).half()
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight, qzeros = pack_gptq(codes, zeros)
    w = dequantize_gptq(qweight, qzeros, scales, g_idx).T  # [K, N] float32, independent code
    return (qweight, qzeros, scales, g_idx), w


@pytest.mark.parametrize("m,dtype,act_order,config", [
    (1, torch.float16, False, None),                      # GEMV, split-K atomics
    (1, torch.bfloat16, True, {"SPLIT_K": 1}),            # GEMV, act-order, no split
    (5, torch.float16, True, None),                       # tensor-core path, act-order
    (20, torch.bfloat16, False, {"SPLIT_K": 1}),          # bf16 tl.dot (interpreter pitfall)
    (3, torch.float32, False, None),                      # an fp32 model: exact fp32 dot
])
def test_gptq_matmul_matches_labkit_quant(m, dtype, act_order, config):
    gen = torch.Generator().manual_seed(m)
    args, w = _gptq(256, 96, 64, gen, act_order)
    x = torch.randn(m, 256, generator=gen).to(dtype)
    if dtype == torch.float32:  # as labkit.quant's linear calls it: scales in the model dtype
        args = (args[0], args[1], args[2].float(), args[3])
    y = dq.gptq_matmul(x, *args, config=config)
    assert y.shape == (m, 96) and y.dtype == dtype
    assert rel_err(y, x.float() @ w) < REL[dtype]
    assert rel_err(dq.gptq_matmul_ref(x, *args), x.float() @ w) < REL[dtype]


@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (17, torch.bfloat16)])
def test_awq_matmul_matches_labkit_quant(m, dtype):
    from labkit.quant.packing import dequantize_awq, pack_awq

    gen = torch.Generator().manual_seed(10 + m)
    k, n, gs = 128, 64, 32
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // gs, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // gs, n, generator=gen) * 0.02 + 1e-3).half()
    qweight, qzeros = pack_awq(codes, zeros)
    w = dequantize_awq(qweight, qzeros, scales, gs).T
    x = torch.randn(m, k, generator=gen).to(dtype)
    assert rel_err(dq.awq_matmul(x, qweight, qzeros, scales, gs), x.float() @ w) < REL[dtype]


@pytest.mark.parametrize("m,config", [(1, None), (3, {"SPLIT_K": 1}), (40, None)])
def test_w8a16_matmul_matches_labkit_quant(m, config):
    from labkit.quant.rtn import dequantize_int8, quantize_int8

    gen = torch.Generator().manual_seed(m)
    q, s = quantize_int8(torch.randn(72, 160, generator=gen))
    x = torch.randn(m, 160, generator=gen).half()
    y = dq.w8a16_matmul(x, q, s, config=config)
    assert rel_err(y, x.float() @ dequantize_int8(q, s).T) < REL[torch.float16]


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order", "awq", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemv_kernels_on_ragged_shapes(kind, dtype):
    """The decode GEMV kernels (config BLOCK_M = 1, one program row per row of x) on N that
    no tile divides, several rows, with and without split-K, vs labkit.quant's dequantiser."""
    from labkit.quant.packing import dequantize_awq, pack_awq

    gen = torch.Generator().manual_seed(7)
    k, n, gs = 192, 200, 64
    if kind.startswith("gptq"):
        args, w = _gptq(k, n, gs, gen, act_order=kind.endswith("order"))
        fn = dq.gptq_matmul
    elif kind == "awq":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        zeros = torch.randint(0, 16, (k // gs, n), generator=gen, dtype=torch.int32)
        scales = (torch.rand(k // gs, n, generator=gen) * 0.02 + 1e-3).half()
        qweight, qzeros = pack_awq(codes, zeros)
        args, w = (qweight, qzeros, scales, gs), dequantize_awq(qweight, qzeros, scales, gs).T
        fn = dq.awq_matmul
    else:
        from labkit.quant.rtn import dequantize_int8, quantize_int8

        q, s = quantize_int8(torch.randn(n, k, generator=gen))
        args, w, fn = (q, s), dequantize_int8(q, s).T, dq.w8a16_matmul
    x = torch.randn(3, k, generator=gen).to(dtype)
    for cfg in ({"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4},
                {"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4}):
        y = fn(x, *args, config=cfg)
        assert y.shape == (3, n) and y.dtype == dtype
        assert rel_err(y, x.float() @ w) < REL[dtype], cfg
    assert rel_err(fn(x[:1], *args), x[:1].float() @ w) < REL[dtype]  # the default M = 1 tiles


def test_dequant_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    (qw, qz, s, g_idx), _ = _gptq(64, 16, 32, gen, False)
    with pytest.raises(ValueError, match="K = 64"):
        dq.gptq_matmul(torch.randn(2, 32).half(), qw, qz, s, g_idx)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        dq.gptq_matmul(torch.randn(2, 64).double(), qw, qz, s, g_idx)
    with pytest.raises(ValueError, match="group_size"):
        dq.awq_matmul(torch.randn(2, 64).half(), torch.zeros(64, 2, dtype=torch.int32),
                      torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 16).half(), 24)


def test_nf4_matches_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    gen = torch.Generator().manual_seed(0)
    # bitsandbytes 0.50's CPU dequantize mis-indexes absmax when a row is shorter than a block,
    # so rows here are whole blocks (its quantize_4bit is right in both cases).
    w = torch.randn(6, 128, generator=gen)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    bnb = F.dequantize_4bit(packed, state)
    for dtype in (torch.float32, torch.float16):
        ours = nf4_dequantize(packed, state.absmax, 64, w.shape, dtype)
        torch.testing.assert_close(ours, bnb.to(dtype), atol=0, rtol=0)
    assert (nf4_dequantize(packed, state.absmax, 64, w.shape, torch.float32) - w).abs().max() \
        <= 0.5 * w.abs().max()  # NF4's widest gap is (1 - 0.723) of absmax


@pytest.mark.parametrize("shape", [(5, 40), (3, 7, 9)])  # 200 = 3 blocks + tail; 189: odd
def test_nf4_matches_labkit_quant_and_odd_tail(shape):
    from labkit.quant.nf4 import quantize_nf4

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    qt = quantize_nf4(w, blocksize=64)
    ours = nf4_dequantize(qt.packed(), qt.absmax, 64, w.shape, torch.float32)
    torch.testing.assert_close(ours, qt.dequantize(torch.float32), atol=0, rtol=0)
    torch.testing.assert_close(ours, nf4_dequantize_ref(qt.packed(), qt.absmax, 64, w.shape,
                                                        torch.float32), atol=0, rtol=0)
    with pytest.raises(ValueError, match="absmax"):
        nf4_dequantize(qt.packed(), qt.absmax[:2], 64, w.shape)
