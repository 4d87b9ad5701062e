"""The planned LoRA ops (labkit.lora.punica) against the per-slot reference (labkit.lora.ops):
a prefill-shaped step (segments), a decode step (one row each), base rows left bitwise alone."""

from __future__ import annotations

import pytest
import torch

from labkit.lora.ops import bgmv_expand, bgmv_shrink
from labkit.lora.punica import TorchPunica, TritonPunica

S, R, H_IN, H_OUT = 3, 8, 24, 40


def factors(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(S, R, H_IN, generator=g)
    b = torch.randn(S, H_OUT, R, generator=g)
    return a, b, torch.tensor([0.5, 2.0, 1.5])


@pytest.mark.parametrize("punica_cls", [TorchPunica, TritonPunica])
@pytest.mark.parametrize("slots,qlens", [
    ([1, 1, 1, -1, -1, 0, 0, 0, 0, 2], [3, 2, 4, 1]),   # prefill chunks + a decode row
    ([2, -1, 0, 2, 1, 1], [1] * 6),                      # decode: any slot per row
])
def test_planned_ops_equal_the_reference(punica_cls, slots, qlens):
    a, b, sc = factors()
    t = torch.tensor(slots)
    x = torch.randn(len(slots), H_IN, generator=torch.Generator().manual_seed(1))
    y0 = torch.randn(len(slots), H_OUT, generator=torch.Generator().manual_seed(2))
    want = y0.clone()
    bgmv_expand(want, bgmv_shrink(x, a, t), b, t, sc)
    p = punica_cls()
    p.prepare(t, qlens)
    assert punica_cls is TorchPunica or p.plan.sgmv == (max(qlens) > 1)
    got = y0.clone()
    p.expand(got, p.shrink(x, a, t), b, t, sc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = t < 0
    assert torch.equal(got[base], y0[base])  # base rows: not a bit changed
    assert not torch.allclose(got[~base], y0[~base])  # adapter rows changed


def test_unprepared_use_is_refused():
    a, _, _ = factors()
    p = TorchPunica()
    with pytest.raises(RuntimeError, match="prepare"):
        p.shrink(torch.zeros(2, H_IN), a, torch.tensor([0, 1]))


@pytest.mark.parametrize("punica_cls", [TorchPunica, TritonPunica])
def test_layer_add_lora_through_packed_weights_equals_the_reference(punica_cls):
    """The engine's path: ``LoRAContext.add_lora`` on a real ``LoRALinear`` whose slots were
    written by ``set_slot`` (TorchPunica reads the packed, pre-scaled B it keeps). Includes a
    slot re-written with a lower rank and a slot cleared (an adapter not targeting the layer):
    a stale packed row would show up as a wrong delta there."""
    from labkit.lora.layers import LoRAContext, LoRALinear

    a, b, sc = factors(3)
    ctx = LoRAContext(punica=punica_cls())
    layer = LoRALinear(torch.nn.Linear(H_IN, H_OUT), ctx, S, R, torch.float32,
                       torch.device("cpu"))
    for s in range(S):
        layer.set_slot(s, a[s], b[s], float(sc[s]))
    layer.set_slot(1, a[1, :4], b[1, :, :4], 3.0)   # lower rank: the rest zero-padded
    layer.set_slot(2, None, None, 0.0)              # cleared
    ref_a, ref_b = a.clone(), b.clone()
    ref_a[1, 4:], ref_b[1, :, 4:], ref_a[2], ref_b[2] = 0, 0, 0, 0
    ref_sc = torch.tensor([float(sc[0]), 3.0, 0.0])
    t = torch.tensor([0, 1, -1, 2, 1, 0])
    x = torch.randn(len(t), H_IN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y0 = layer.base_layer(x)
        want = y0.clone()
        bgmv_expand(want, bgmv_shrink(x, ref_a, t), ref_b, t, ref_sc)
        ctx.update_metadata(t, [1] * len(t))
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], y0[2]) and torch.equal(got[3], y0[3])  # base row, cleared slot
