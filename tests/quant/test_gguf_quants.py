"""labkit's GGML block quantizers against the gguf package (bytes) and its dequantizers.

Q8_0, Q4_0 and Q5_0 have a numpy reference in ``gguf.quants``: labkit's bytes must be identical.
Q4_K and Q6_K have only a dequantizer there, so those are checked by (a) the reference
dequantizer reading labkit's bytes back to within the format's error, (b) hand-computed cases of
the layout, and (c) in the llama.cpp interop job, byte equality with ggml's own C quantizer.
"""

from __future__ import annotations

import numpy as np
import pytest

from labkit.quant.errors import QuantizationError
from labkit.quant.gguf import bits_per_weight, quantize, tensor_type, use_more_bits
from labkit.quant.gguf_quants import nearest_int, round_away

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as ref_dequantize  # noqa: E402
from gguf.quants import quantize as ref_quantize  # noqa: E402


def _weights(rows=16, cols=512, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :256] = 0.0  # an all-zero super-block
    w[2, 40] = 0.7  # an outlier
    w[3, :32] = np.float32(0.25)  # a constant block
    w[4, 64:96] = -np.abs(w[4, 64:96])  # an all-negative block (sign of the extreme matters)
    w[5] *= 1e4  # a large-magnitude row
    w[6, :16] = np.float32(1e-3) * (np.arange(16) % 2)  # ties in |x|
    return w


@pytest.mark.parametrize("name,qtype", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q5_0", T.Q5_0)])
@pytest.mark.parametrize("shape", [(16, 512), (3, 5, 64), (32,)])
def test_bytes_equal_gguf_reference(name, qtype, shape):
    w = _weights(seed=len(shape)).reshape(-1)[: int(np.prod(shape))].reshape(shape)
    ours, ref = quantize(w, name), ref_quantize(w, qtype)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name,qtype", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0)])
def test_negative_control_a_one_ulp_change_is_seen(name, qtype):
    """The byte comparison is sharp: perturbing one weight's scale source changes the bytes."""
    w = _weights()
    bumped = w.copy()
    bumped[2, 40] = np.nextafter(np.float32(0.7), np.float32(1.0)) * 1.01
    assert not np.array_equal(quantize(bumped, name), ref_quantize(w, qtype))


@pytest.mark.parametrize("name,qtype,rel_err", [("q4_k", T.Q4_K, 0.09), ("q6_k", T.Q6_K, 0.025)])
def test_k_quants_read_back_by_reference_dequantizer(name, qtype, rel_err):
    w = _weights(rows=32)
    raw = quantize(w, name)
    assert raw.shape == (32, 512 // 256 * {"q4_k": 144, "q6_k": 210}[name])
    back = ref_dequantize(raw, qtype)
    normal = np.r_[7:32]  # rows without planted special cases
    err = np.abs(back[normal] - w[normal]).mean() / np.abs(w[normal]).mean()
    assert err < rel_err
    np.testing.assert_array_equal(back[1, :256], 0.0)  # zero super-block stays exactly zero
    # each k-quant beats the 32-block type of similar size on the same weights
    simpler = {"q4_k": T.Q4_0, "q6_k": T.Q5_0}[name]
    simple_err = np.abs(ref_dequantize(ref_quantize(w, simpler), simpler)[normal]
                        - w[normal]).mean() / np.abs(w[normal]).mean()
    assert err < simple_err


def test_q4_k_layout_by_hand():
    """One super-block whose sub-block j holds the values 0..15 times (j+1): exactly
    representable, so every code is its index and scale j is proportional to j+1."""
    x = np.concatenate([np.arange(32) % 16 * (j + 1) for j in range(8)]).astype(np.float32)
    raw = quantize(x, "q4_k")
    d = raw[0:2].view(np.float16)[0]
    dmin = raw[2:4].view(np.float16)[0]
    assert float(d) == pytest.approx(8 / 63, rel=1e-3) and float(dmin) == 0.0
    scales = raw[4:16]
    # scale j is 6 bits: j<4 in byte j; j>=4 low nibble in byte j+4, top 2 bits atop byte j-4
    six_bit = [scales[j] & 63 if j < 4 else (scales[j + 4] & 0x0F) | (scales[j - 4] >> 6) << 4
               for j in range(8)]
    np.testing.assert_allclose(six_bit, [63 * (j + 1) / 8 for j in range(8)], atol=0.5)
    qs = raw[16:].reshape(4, 32)
    np.testing.assert_array_equal(qs[0] & 0x0F, np.arange(32) % 16)  # sub-block 0, low nibbles
    np.testing.assert_array_equal(qs[0] >> 4, np.arange(32) % 16)  # sub-block 1, high nibbles
    np.testing.assert_allclose(ref_dequantize(raw, T.Q4_K), x, rtol=0.02, atol=0.02)


def test_rounding_helpers_match_c():
    v = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.49999976], np.float32)
    np.testing.assert_array_equal(nearest_int(v), [0, 2, 2, 0, -2, 3])  # ties to even
    np.testing.assert_array_equal(round_away(v), [1, 2, 3, -1, -3, 3])  # roundf


def test_bad_input_is_named():
    with pytest.raises(QuantizationError, match="multiple"):
        quantize(np.zeros((2, 48), np.float32), "q8_0")
    with pytest.raises(QuantizationError, match="q4_k"):
        quantize(np.zeros(256, np.float32), "q3_k")
    with pytest.raises(QuantizationError, match="NaN"):
        quantize(np.full(32, np.nan, np.float32), "q4_0")


def test_q4_k_m_mix_follows_llama_quantize():
    # labkit-tiny: 6 layers (layers 2 and 5 get more bits), hidden 256, FFN 704 (not a
    # multiple of 256), tied embeddings
    mix = {n: tensor_type(n, s, "q4_k_m", 6, True) for n, s in [
        ("token_embd.weight", (4096, 256)), ("blk.0.attn_q.weight", (256, 256)),
        ("blk.2.attn_v.weight", (64, 256)), ("blk.1.attn_v.weight", (64, 256)),
        ("blk.5.ffn_down.weight", (256, 704)), ("blk.1.ffn_down.weight", (256, 704)),
        ("blk.0.ffn_up.weight", (704, 256)), ("blk.0.attn_norm.weight", (256,))]}
    assert mix == {"token_embd.weight": "q6_k", "blk.0.attn_q.weight": "q4_k",
                   "blk.2.attn_v.weight": "q6_k", "blk.1.attn_v.weight": "q4_k",
                   "blk.5.ffn_down.weight": "q8_0", "blk.1.ffn_down.weight": "q5_0",
                   "blk.0.ffn_up.weight": "q4_k", "blk.0.attn_norm.weight": "f32"}
    assert [use_more_bits(i, 32) for i in range(8)] == [1, 1, 1, 1, 0, 0, 1, 0]
    assert tensor_type("output.weight", (97, 256), "q4_0", 2, False) == "q6_k"
    assert tensor_type("output.weight", (97, 64), "q4_0", 2, False) == "q8_0"
    assert tensor_type("blk.0.ffn_down.weight", (64, 128), "q4_0", 2, False) == "q4_0"
    assert tensor_type("blk.0.ffn_down.weight", (64, 112), "q4_0", 2, False) == "f16"
    assert bits_per_weight("q4_k") == 4.5 and bits_per_weight("q6_k") == 6.5625
