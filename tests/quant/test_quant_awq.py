"""AWQ: scale folding is an exact identity, the searches never make things worse, and on a
model with loud activation channels AWQ beats round-to-nearest."""

import pytest
import torch

from labkit.quant import QuantizationError, awq_quantize_model, quantize_model
from labkit.quant.awq import fold_scales, search_clip
from labkit.quant.rtn import fake_quantize


def test_fold_scales_preserves_the_full_precision_model(tiny):
    x = torch.randint(0, 128, (2, 12))
    ref = tiny(x)
    g = torch.Generator().manual_seed(0)
    for layer in tiny.model.layers:
        a, m = layer.self_attn, layer.mlp
        fold_scales(layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj],
                    torch.rand(64, generator=g) + 0.5)
        fold_scales(layer.post_attention_layernorm, [m.gate_proj, m.up_proj],
                    torch.rand(64, generator=g) + 0.5)
        fold_scales(m.up_proj, [m.down_proj], torch.rand(128, generator=g) + 0.5)
        # GQA (4 query heads, 2 kv heads, dim 16): o_proj columns of query heads 0,1 share
        # v_proj channels of kv head 0, so their scales are tied
        t = torch.rand(2, 1, 16, generator=g) + 0.5
        fold_scales(a.v_proj, [a.o_proj], t.expand(2, 2, 16).reshape(-1), t.reshape(-1))
    torch.testing.assert_close(tiny(x), ref, atol=1e-5, rtol=1e-4)


def test_clip_search_never_increases_output_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[:, 5] *= 8  # a few large weights stretch their groups' ranges
    x = torch.randn(256, 64, generator=g)
    clipped = search_clip(w, x, 32)
    assert clipped.abs().le(w.abs() + 1e-7).all()

    def err(m):
        return ((x @ fake_quantize(m, 4, 32).T - x @ w.T) ** 2).mean()

    assert err(clipped) <= err(w)


def _loud_model(make_tiny):
    """Tiny model whose RMSNorm weights make a few hidden channels 15x louder (as real LLMs)."""
    m = make_tiny(seed=3)
    with torch.no_grad():
        for layer in m.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] = 15.0
    return m


def test_awq_beats_rtn_and_reports_losses(calib_tokens, make_tiny_model):
    m = _loud_model(make_tiny_model)
    qm, report = awq_quantize_model(m, calib_tokens, group_size=32, n_grid=10, progress=False)
    assert {r["layer"].split(".")[-1] for r in report} == {"qkv", "o", "gate_up", "down"}
    assert all(r["loss_after"] <= r["loss_before"] for r in report)
    assert any(r["alpha"] > 0 for r in report)
    rtn = quantize_model(m, "int4_rtn", group_size=32)
    x = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(9))
    ref = torch.log_softmax(m(x), -1)

    def kl(model):
        return (ref.exp() * (ref - torch.log_softmax(model(x), -1))).sum(-1).mean()

    assert kl(qm) < kl(rtn)


def test_awq_without_gqa_and_tied_gqa_scales(calib_tokens, make_tiny_model):
    m = make_tiny_model(num_key_value_heads=4)
    _, report = awq_quantize_model(m, calib_tokens, group_size=32, n_grid=4, clip=False,
                                   progress=False)
    assert sum(r["layer"].endswith(".o") for r in report) == 2
    from labkit.quant.awq import _tie_gqa

    t = _tie_gqa(torch.arange(8.0), kv=2, rep=2, d=2)  # heads (0,1) and (2,3) share
    assert t.tolist() == [1.0, 2.0, 1.0, 2.0, 5.0, 6.0, 5.0, 6.0]


def test_awq_rejects_bad_group_size(tiny, calib_tokens):
    with pytest.raises(QuantizationError, match="group_size=48"):
        awq_quantize_model(tiny, calib_tokens, group_size=48, progress=False)
