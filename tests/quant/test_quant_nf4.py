"""NF4/FP4 against bitsandbytes 0.50 (CPU) bit for bit, and the NF4 levels against their
definition (normal quantiles)."""

import pytest
import torch

from labkit.quant import QuantizationError, quantize_fp4, quantize_nf4
from labkit.quant.nf4 import NF4_CODE, double_quantize, unpack_4bit

bnb_f = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed")

FNS = {"nf4": quantize_nf4, "fp4": quantize_fp4}


def _tensors():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(64, 128, generator=g)
    yield torch.randn(3, 37, generator=g) * 5  # ragged last block, odd numel
    yield torch.randn(1000, generator=g)
    yield torch.randn(2, 3, 33, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 64, generator=g)
    w[0] = 0.0  # an all-zero block
    w[1, :8] = torch.tensor([1e-30, -1e-30, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5])
    yield w
    # values exactly on the midpoints between NF4 levels (the tie rule)
    mids = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    yield torch.cat([mids, torch.tensor([1.0]), -mids.flip(0), torch.tensor([-1.0])]).repeat(2)
    yield torch.randn(128, 64, generator=g).half() * 0.02
    yield torch.zeros(40)  # all zeros, shorter than one block (absmax stored clamped)
    yield torch.randn(300, 200, generator=g).T  # non-contiguous: row-major logical order


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128, 256])
def test_codes_absmax_and_dequant_equal_bitsandbytes(quant_type, blocksize):
    for w in _tensors():
        packed, state = bnb_f.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type)
        ref_codes = unpack_4bit(packed, w.numel())
        mine = FNS[quant_type](w, blocksize)
        assert mine.codes.dtype == torch.uint8 and mine.codes.shape == (w.numel(),)
        assert torch.equal(mine.codes, ref_codes), (quant_type, blocksize, w.shape)
        assert torch.equal(mine.absmax, state.absmax)
        assert torch.equal(mine.packed(), packed.view(-1))
        if w.shape[-1] % blocksize and w.shape[-1] % 2 == 0:
            # bitsandbytes 0.50's CPU C++ dequantize kernel restarts blocks at every row,
            # disagreeing with its own quantize (blocks run over the flattened tensor) when
            # rows are shorter than a block; check the definition instead.
            code = mine.code[mine.codes.long()]
            idx = torch.arange(w.numel()) // blocksize
            ref_dq = (code * state.absmax[idx]).reshape(w.shape).to(w.dtype)
        else:
            ref_dq = bnb_f.dequantize_4bit(packed, state).reshape(w.shape)  # in w's dtype
        assert torch.equal(mine.dequantize(w.dtype), ref_dq)


def test_nf4_levels_are_normal_quantiles():
    """QLoRA: 8 positive and 7 negative quantiles of N(0,1) at offset 0.9677, plus 0, / max."""
    from scipy.stats import norm

    offset = 0.9677083
    pos = norm.ppf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1].numpy()).tolist()
    neg = (-norm.ppf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1].numpy())).tolist()
    v = torch.tensor(sorted(pos + [0.0] + neg), dtype=torch.float64)
    v = v / v.abs().max()
    assert torch.allclose(NF4_CODE.double(), v, atol=1e-6)


def test_one_nf4_table_equals_bitsandbytes():
    """The table lives once (kernels/nf4_code.py); quantizer, dequant kernel and the exercises
    all read it, and it is bitsandbytes' own table bit for bit."""
    from labkit.kernels import nf4 as kernel_nf4
    from labkit.kernels.nf4_code import NF4_LEVELS

    from labkit.exercises import quantization

    assert torch.equal(NF4_CODE, torch.tensor(NF4_LEVELS))
    assert torch.equal(kernel_nf4._code(torch.device("cpu")), NF4_CODE)
    assert quantization.NF4_CODE is NF4_CODE
    assert torch.equal(bnb_f.get_4bit_type("nf4", device="cpu").float(), NF4_CODE)


def test_hand_example():
    w = torch.tensor([[0.0, 2.0, -2.0, 1.0]])
    q = quantize_nf4(w, blocksize=32)
    assert q.absmax.tolist() == [2.0]
    # 0 -> level 7 (0.0), 2 -> 15 (1.0), -2 -> 0 (-1.0), 1 -> 0.5 is nearest to 0.4407 (12)
    assert q.codes.tolist() == [7, 15, 0, 12]
    assert q.packed().tolist() == [0x7F, 0x0C]


def test_double_quant_is_close_and_smaller():
    g = torch.Generator().manual_seed(3)
    q = quantize_nf4(torch.randn(256, 256, generator=g), 64)
    dq = double_quantize(q.absmax)
    err = (dq.dequantize() - q.absmax).abs()
    step = dq.scale.repeat_interleave(256)[: q.absmax.numel()]
    assert (err <= step / 2 + 1e-6).all()
    assert dq.q8.numel() * 1 + dq.scale.numel() * 4 < q.absmax.numel() * 4 / 3


def test_bad_input():
    with pytest.raises(QuantizationError, match="blocksize"):
        quantize_nf4(torch.randn(4, 64), blocksize=100)
    with pytest.raises(QuantizationError, match="empty"):
        quantize_nf4(torch.empty(0))
    with pytest.raises(QuantizationError, match="floating"):
        quantize_fp4(torch.ones(4, dtype=torch.int32))


def test_bitsandbytes_linear4bit_backend_matches_labkit_nf4(tiny):
    from labkit.quant import quantize_model, to_bnb_linear4bit

    x = torch.randint(0, 128, (2, 16))
    ours = quantize_model(tiny, "nf4", blocksize=64)
    theirs = to_bnb_linear4bit(tiny, "nf4", blocksize=64)
    assert type(theirs.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours(x), tiny(x), atol=1e-5)  # it did quantize


def test_random_shapes_scales_and_dtypes_equal_bitsandbytes():
    import random

    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(80):
        shape = tuple(rng.randint(1, 70) for _ in range(rng.randint(1, 3)))
        scale = 10 ** rng.uniform(-30, 30)
        w = torch.randn(shape, generator=g) * scale
        if rng.random() < 0.3:  # coarse values: many exact ties and duplicates
            w = torch.round(w / scale * 4) * scale / 4
        if rng.random() < 0.3:
            w = w.to(rng.choice([torch.float16, torch.bfloat16]))
        bs, qt = rng.choice([32, 64, 128, 256, 512]), rng.choice(["nf4", "fp4"])
        packed, state = bnb_f.quantize_4bit(w, blocksize=bs, quant_type=qt)
        mine = FNS[qt](w, bs)
        assert torch.equal(mine.codes, unpack_4bit(packed, w.numel())), (shape, bs, qt)
        assert torch.equal(mine.absmax, state.absmax)
