"""The batched LoRA delta (bgmv_shrink / bgmv_expand) against a per-token loop written from the
definition: y[t] += scaling[s] * B[s] @ (A[s] @ x[t]) for s = slot[t] >= 0, nothing for -1."""

from __future__ import annotations

import torch

from labkit.lora.ops import bgmv_expand, bgmv_shrink


def reference(y, x, a, b, slots, scalings):
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scalings[s] * (b[s] @ (a[s] @ x[t]))
    return out


def test_mixed_slots_match_the_per_token_definition():
    g = torch.Generator().manual_seed(0)
    S, r, h_in, h_out, T = 3, 8, 24, 40, 11
    x = torch.randn(T, h_in, generator=g)
    a = torch.randn(S, r, h_in, generator=g)
    b = torch.randn(S, h_out, r, generator=g)
    a[1, 4:] = 0  # slot 1 holds a rank-4 adapter, zero-padded to 8
    b[1, :, 4:] = 0
    scalings = torch.tensor([2.0, 0.5, 1.0])
    slots = torch.tensor([0, -1, 1, 1, -1, 0, 2, -1, 2, 0, 1])
    y = torch.randn(T, h_out, generator=g)
    want = reference(y, x, a, b, slots, scalings)
    base_rows = y[slots < 0].clone()
    buf = bgmv_shrink(x, a, slots)
    assert buf.shape == (T, r)
    assert torch.equal(buf[slots < 0], torch.zeros(3, r))
    bgmv_expand(y, buf, b, slots, scalings)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[slots < 0], base_rows)  # base rows untouched, bit for bit


def test_all_base_rows_and_an_unused_slot_change_nothing():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 6, generator=g)
    a, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 4, generator=g)
    slots = torch.full((4,), -1)
    before = y.clone()
    bgmv_expand(y, bgmv_shrink(x, a, slots), b, slots, torch.ones(2))
    assert torch.equal(y, before)
