"""The packed CPU paths (torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu) against the
reference dequantize-then-matmul of the same layer.

Tolerance: the kernels are vectorised for bf16 activations only, so x, scales and zero points
are rounded to bf16 (relative 2^-9) and accumulate in fp32: |y - y_ref| <= 1e-2 * max|y_ref|.
A wrong zero point, group or permutation errs by the size of a quantization step (tens of
percent), far outside it (the last test checks that the tolerance does catch such a mistake)."""

import pytest
import torch

from labkit.quant import cpu_packed
from labkit.quant.gptq import gptq_quantize
from labkit.quant.linear import AWQLinear, GPTQLinear, W8A16Linear, use_cpu_packed
from labkit.quant.rtn import quantize_int8, quantize_rtn


def _close(layer, x):
    with use_cpu_packed(False):
        ref = layer(x)
    y = layer(x)
    assert layer.cpu_pack() is not None, "the packed path was not taken"
    tol = 1e-2 * ref.abs().max()
    assert (y - ref).abs().max() <= tol
    return y, ref


def _w(n=64, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_packed_equals_dequantize_matmul():
    w = _w()
    layer = W8A16Linear(*quantize_int8(w), bias=torch.randn(64))
    _close(layer, _x(3, 5, 256))
    assert layer.cpu_pack().qweight.dtype == torch.int8  # the int8 bytes, not a float copy


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 64), (4, 32), (2, 128)])
def test_int4_rtn_packed_equals_dequantize_matmul(bits, group):
    layer = GPTQLinear.from_quant(quantize_rtn(_w(), bits, group))
    _close(layer, _x(2, 256))
    assert layer.cpu_pack().perm is None


def test_gptq_act_order_is_permuted_exactly():
    w, x = _w(64, 256), _x(64, 256, seed=2)
    H = 2 * x.T.double() @ x.double() / 64 + torch.diag(torch.rand(256, dtype=torch.float64))
    q = gptq_quantize(w, H, bits=4, group_size=64, act_order=True).quant
    assert not torch.equal(q.g_idx.long(), torch.arange(256) // 64)  # really permuted
    layer = GPTQLinear.from_quant(q)
    _close(layer, _x(4, 256))
    perm = layer.cpu_pack().perm
    assert perm is not None and torch.equal(q.g_idx.long()[perm], torch.arange(256) // 64)


def test_awq_layout_packed_equals_dequantize_matmul():
    layer = AWQLinear.from_quant(quantize_rtn(_w(32, 128), 4, 64), bias=torch.randn(32))
    _close(layer, _x(1, 1, 128))


def test_layouts_the_kernel_refuses_fall_back_to_dequantize():
    # 40 output features (not a multiple of 16); group 16 (not a kernel group size)
    for layer in (GPTQLinear.from_quant(quantize_rtn(_w(40, 128), 4, 64)),
                  GPTQLinear.from_quant(quantize_rtn(_w(64, 128), 4, 16)),
                  GPTQLinear.from_quant(quantize_rtn(_w(64, 128), 8, 64))):
        assert layer.cpu_pack() is None
        x = _x(2, 128)
        with use_cpu_packed(False):
            ref = layer(x)
        assert torch.equal(layer(x), ref)
    assert "multiple of 16" in cpu_packed.int4_layout_problem(40, 128, 64)


def test_unequal_groups_have_no_contiguous_permutation():
    g = torch.tensor([0, 0, 0, 1] * 16)
    assert cpu_packed.contiguous_group_perm(g, 32) is None
    g = torch.arange(64) // 32
    assert torch.equal(cpu_packed.contiguous_group_perm(g.flip(0), 32)[:32],
                       torch.arange(32, 64))


def test_pack_is_rebuilt_after_loading_new_weights():
    a = W8A16Linear(*quantize_int8(_w(seed=0)))
    b = W8A16Linear(*quantize_int8(_w(seed=5)))
    x = _x(1, 256)
    a(x)
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), b(x))


def test_tolerance_catches_a_wrong_zero_point():
    """The negative control: int4 with the zero point left out errs far beyond 1e-2."""
    q = quantize_rtn(_w(), 4, 64)
    layer = GPTQLinear.from_quant(q)
    good = layer.cpu_pack()
    s = good.scales_and_zeros.clone()
    s[..., 1] = 0
    bad = cpu_packed.Int4Pack(good.packed, s, good.group_size)
    x = _x(2, 256)
    with use_cpu_packed(False):
        ref = layer(x)
    assert (bad.matmul(x) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_quantized_model_engine_greedy_equals_reference(make_tiny_model):
    from labkit import LLM, SamplingParams
    from labkit.model.generate import generate
    from labkit.quant import quantize_model

    m = quantize_model(make_tiny_model(hidden_size=64, intermediate_size=128), "int4_rtn",
                       group_size=64)
    prompt = [3, 17, 42, 9, 100]
    ref = generate(m, prompt, 12, ignore_eos=True)
    out = LLM(m).generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False))
    assert out[0].outputs[0].token_ids == ref
