"""INT8 / INT4-RTN / FP8 quantizers, the LLM.int8 demonstrator and quantized linear layers,
against hand-computed values and plain-torch references."""

import pytest
import torch
import torch.nn.functional as F

from labkit.quant import (
    FP8Linear,
    QuantizationError,
    W8A16Linear,
    int8_outlier_matmul,
    quantize_fp8,
    quantize_int8,
    quantize_model,
    quantize_rtn,
)
from labkit.quant.linear import GPTQLinear, NF4Linear, QuantLinear, use_cpu_packed
from labkit.quant.outliers import int8_vectorwise_matmul


def test_int8_hand_example():
    w = torch.tensor([[1.27, -0.635, 0.0], [0.1, -0.2, 0.05]])
    q, s = quantize_int8(w)
    assert s.dtype == torch.float16
    assert torch.allclose(s.float(), torch.tensor([0.01, 0.2 / 127]).half().float())
    assert q.tolist()[0] == [127, round(-0.635 / float(s[0])), 0]
    assert q[1, 1] == -127
    err = (q.float() * s.float()[:, None] - w).abs()
    assert (err <= s.float()[:, None] / 2 + 1e-7).all()


def test_int4_group_rtn_hand_example():
    # one group of 4: min -1, max 2 -> scale 3/15 = 0.2, zero = round(1/0.2) = 5
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    q = quantize_rtn(w, bits=4, group_size=-1)
    assert q.scales.item() == pytest.approx(0.2, rel=1e-3)
    assert q.zeros.item() == 5
    assert q.codes.tolist() == [[0, 5, round(0.5 / q.scales.item()) + 5, 15]]
    assert torch.allclose(q.dequantize(), w, atol=q.scales.item() / 2)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_rtn_error_bound_and_groups(group_size):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 256, generator=g)
    q = quantize_rtn(w, 4, group_size)
    assert q.scales.shape == (256 // group_size, 24) and q.codes.max() <= 15
    assert ((q.zeros >= 0) & (q.zeros <= 15)).all()
    step = q.scales.T.repeat_interleave(group_size, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    # smaller groups can only fit the weights better on average
    if group_size > 32:
        assert (quantize_rtn(w, 4, 32).dequantize() - w).pow(2).mean() < \
            (q.dequantize() - w).pow(2).mean()


def test_bad_bits_and_group_sizes():
    w = torch.randn(8, 96)
    with pytest.raises(QuantizationError, match="bits=3"):
        quantize_rtn(w, bits=3)
    with pytest.raises(QuantizationError, match="group_size=48"):
        quantize_rtn(w, group_size=48)
    with pytest.raises(QuantizationError, match="not divisible"):
        quantize_rtn(w, group_size=64)
    with pytest.raises(QuantizationError, match="2-D"):
        quantize_int8(torch.randn(3))


def test_fp8_is_nearest_representable_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    # every finite e4m3 value, by enumerating all 256 bit patterns
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    scaled = w / s[:, None]
    dist = (scaled[..., None] - grid).abs()
    nearest = grid[dist.argmin(-1)]
    tie = (dist.topk(2, largest=False).values.diff(dim=-1).abs() < 1e-7).squeeze(-1)
    assert torch.equal(q.float()[~tie], nearest[~tie])
    assert q.float().abs().amax(dim=1).eq(448).all()  # row max maps to the largest value


def test_int8_vectorwise_matmul_hand():
    x = torch.tensor([[127.0, -63.5]])
    w = torch.tensor([[1.0], [2.0]])
    # sx = 1, sw = 2/127: qx = [127, -64] (round half to even gives -64), qw = [64, 127]
    out = int8_vectorwise_matmul(x, w)
    expect = (127 * 64 + (-64) * 127) * 1.0 * (2 / 127)
    assert out.item() == pytest.approx(expect, rel=1e-6)


def test_llm_int8_outlier_decomposition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g)
    x[:, [5, 77]] *= 60  # systematic outlier features, as in large LLMs
    w = torch.randn(256, 64, generator=g) * 0.05
    r = int8_outlier_matmul(x, w, threshold=6.0)
    assert r.outlier_dims.tolist() == [5, 77]
    assert r.error_decomposed < r.error_plain_int8 / 5
    torch.testing.assert_close(r.output, x @ w, atol=0.05, rtol=0.01)
    # no outliers above threshold: decomposition is exactly plain vector-wise int8
    r2 = int8_outlier_matmul(x, w, threshold=1e9)
    assert r2.outlier_dims.numel() == 0 and torch.equal(r2.output, int8_vectorwise_matmul(x, w))


@pytest.mark.parametrize("fmt", ["int8", "int4_rtn", "nf4", "fp8"])
def test_quantized_linears_compute_with_their_dequantized_weight(tiny, fmt):
    qm = quantize_model(tiny, fmt, group_size=32)
    layers = [m for m in qm.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7
    assert isinstance(qm.lm_head, torch.nn.Linear)  # lm_head stays full precision
    x = torch.randn(3, 5, 64)
    lin = qm.model.layers[0].self_attn.q_proj
    ref = F.linear(x, lin.dequantize())
    with use_cpu_packed(False):  # the reference path: exactly the dequantized weight
        torch.testing.assert_close(lin(x), ref)
    # INT8 / INT4 take the packed CPU kernels (bf16 activations): within their tolerance
    assert (lin(x) - ref).abs().max() <= 1e-2 * ref.abs().max()
    orig = tiny.model.layers[0].self_attn.q_proj.weight
    rel = (lin.dequantize() - orig).norm() / orig.norm()
    assert 0 < rel < {"int8": 0.01, "fp8": 0.05, "int4_rtn": 0.12, "nf4": 0.12}[fmt]
    expect = {"int8": W8A16Linear, "int4_rtn": GPTQLinear, "nf4": NF4Linear, "fp8": FP8Linear}
    assert isinstance(lin, expect[fmt])


def test_quantized_model_greedy_generation_matches_its_own_full_forward(tiny):
    """The quantized model is a normal model for generate(): cached decode == no-cache forward."""
    from labkit.model.generate import generate

    qm = quantize_model(tiny, "int4_rtn", group_size=32)
    prompt = [1, 5, 9, 3]
    out = generate(qm, prompt, 6, ignore_eos=True)
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(qm(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_unknown_format(tiny):
    with pytest.raises(QuantizationError, match="unknown format"):
        quantize_model(tiny, "int3")


@pytest.mark.parametrize("fmt", ["int8", "int4_rtn", "nf4"])
def test_quantized_model_runs_in_the_paged_engine_token_for_token(tiny, fmt):
    """Quantized linears plug into the engine: greedy output == reference generate."""
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.generate import generate

    qm = quantize_model(tiny, fmt, group_size=32)
    prompts = [[1, 5, 9, 3], [7, 7, 2, 11, 40, 3, 9], [100]]
    llm = LLM.from_model(qm, None, block_size=4)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == \
        [generate(qm, p, 10, ignore_eos=True) for p in prompts]
