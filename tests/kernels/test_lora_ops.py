"""Multi-LoRA shrink/expand (BGMV, SGMV) under the interpreter against the loop over slots and a
per-row hand loop ``y += scaling * (x @ A.T) @ B.T``; base rows (slot -1) bitwise untouched."""

import pytest
import torch
from labkit.kernels import lora_ops as lo

REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _adapters(num_slots, r, h_in, h_out, dtype, gen):
    a = (torch.randn(num_slots, r, h_in, generator=gen) / h_in**0.5).to(dtype)
    b = (torch.randn(num_slots, h_out, r, generator=gen) / r**0.5).to(dtype)
    scalings = torch.rand(num_slots, generator=gen) * 2 + 0.5  # alpha / r, distinct per slot
    return a, b, scalings


def _hand(y, x, a, b, scalings, token_slots):
    """Row by row in float64: y[t] += s * (x[t] @ A.T) @ B.T for its slot, nothing for -1."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            shrunk = x[t].double() @ a[slot].double().T
            out[t] += float(scalings[slot]) * (shrunk @ b[slot].double().T)
    return out


def _expand_skips_base_rows(expand, expand_ref, y0, b, scalings, gen, token_slots, *mapping):
    """Even with a nonzero buf on base rows (adding 0 would hide a write) they stay as they
    were, and the adapter rows still match the reference."""
    buf = torch.randn(y0.shape[0], b.shape[2], generator=gen)
    y, y_ref = y0.clone(), y0.clone()
    expand(y, buf, b, *mapping, scalings)
    expand_ref(y_ref, buf, b, *mapping, scalings)
    base = token_slots < 0
    assert torch.equal(y[base], y0[base]) and torch.equal(y_ref[base], y0[base])
    assert rel_err(y - y0, y_ref - y0) < REL[y0.dtype]


def _segments_to_token_slots(seg_starts, seg_slots, t):
    slots = torch.full((t,), -1, dtype=torch.long)
    for g, slot in enumerate(seg_slots.tolist()):
        slots[int(seg_starts[g]):int(seg_starts[g + 1])] = slot
    return slots


@pytest.mark.parametrize("r,dtype,config", [
    (8, torch.float32, None),
    (16, torch.float32, {"BLOCK_K": 16, "SPLIT_K": 3}),  # K split over 3 programs, summed after
    (64, torch.float32, None),
    (16, torch.bfloat16, None),
])
def test_bgmv_mixed_slots(r, dtype, config):
    gen = torch.Generator().manual_seed(r)
    t, h_in, h_out, num_slots = 7, 48, 40, 3
    a, b, scalings = _adapters(num_slots, r, h_in, h_out, dtype, gen)
    x = torch.randn(t, h_in, generator=gen).to(dtype)
    y0 = torch.randn(t, h_out, generator=gen).to(dtype)
    token_slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])  # three adapters and the base, mixed
    buf = lo.bgmv_shrink(x, a, token_slots, config=config)
    assert buf.dtype == torch.float32 and buf.shape == (t, r)
    assert rel_err(buf, lo.bgmv_shrink_ref(x, a, token_slots)) < REL[dtype]
    assert (buf[token_slots < 0] == 0).all()
    y, y_ref = y0.clone(), y0.clone()
    lo.bgmv_expand(y, buf, b, token_slots, scalings)
    lo.bgmv_expand_ref(y_ref, buf, b, token_slots, scalings)
    hand = _hand(y0, x, a, b, scalings, token_slots)
    assert rel_err(y - y0, y_ref - y0) < REL[dtype]
    assert rel_err(y.double() - y0.double(), hand - y0.double()) < REL[dtype]
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])  # base rows bitwise untouched
    _expand_skips_base_rows(lo.bgmv_expand, lo.bgmv_expand_ref, y0, b, scalings, gen,
                            token_slots, token_slots)


def test_add_lora_on_a_strided_slice_of_a_fused_output():
    """y is the k-slice of a fused qkv output: strided rows, the q and v columns untouched."""
    gen = torch.Generator().manual_seed(1)
    t, h_in, h_out = 5, 32, 24
    a, b, scalings = _adapters(2, 8, h_in, h_out, torch.float32, gen)
    x = torch.randn(t, h_in, generator=gen)
    qkv0 = torch.randn(t, 3 * h_out, generator=gen)
    token_slots = torch.tensor([1, 0, -1, 1, 0])
    qkv, qkv_ref = qkv0.clone(), qkv0.clone()
    lo.add_lora(qkv[:, h_out:2 * h_out], x, a, b, token_slots, scalings)
    lo.add_lora_ref(qkv_ref[:, h_out:2 * h_out], x, a, b, token_slots, scalings)
    hand = _hand(qkv0[:, h_out:2 * h_out], x, a, b, scalings, token_slots)
    assert rel_err(qkv - qkv0, qkv_ref - qkv0) < 1e-5
    assert rel_err(qkv[:, h_out:2 * h_out].double() - qkv0[:, h_out:2 * h_out].double(),
                   hand - qkv0[:, h_out:2 * h_out].double()) < 1e-5
    assert torch.equal(qkv[:, :h_out], qkv0[:, :h_out])
    assert torch.equal(qkv[:, 2 * h_out:], qkv0[:, 2 * h_out:])
    assert torch.equal(qkv[2], qkv0[2])


@pytest.mark.parametrize("r,seg_starts,seg_slots,dtype", [
    # an empty segment, a base segment and the same adapter in two segments
    (8, [0, 3, 3, 5, 22, 24], [1, 0, -1, 2, 1], torch.float32),
    (16, [0, 20, 20, 21], [0, 2, -1], torch.float32),      # a 20-token prefill: 2 row blocks
    (64, [2, 6, 9], [1, 0], torch.float32),                # rows 0-1 and 9-11 in no segment
    (16, [0, 4, 4, 9], [2, 1, 0], torch.bfloat16),
])
def test_sgmv_segments(r, seg_starts, seg_slots, dtype):
    gen = torch.Generator().manual_seed(100 + r)
    t, h_in, h_out = max(seg_starts[-1], 12), 32, 48
    a, b, scalings = _adapters(3, r, h_in, h_out, dtype, gen)
    x = torch.randn(t, h_in, generator=gen).to(dtype)
    y0 = torch.randn(t, h_out, generator=gen).to(dtype)
    starts, slots = torch.tensor(seg_starts), torch.tensor(seg_slots)
    buf = lo.sgmv_shrink(x, a, starts, slots)
    assert rel_err(buf, lo.sgmv_shrink_ref(x, a, starts, slots)) < REL[dtype]
    y, y_ref = y0.clone(), y0.clone()
    lo.sgmv_expand(y, buf, b, starts, slots, scalings)
    lo.sgmv_expand_ref(y_ref, buf, b, starts, slots, scalings)
    token_slots = _segments_to_token_slots(starts, slots, t)
    hand = _hand(y0, x, a, b, scalings, token_slots)
    assert rel_err(y - y0, y_ref - y0) < REL[dtype]
    assert rel_err(y.double() - y0.double(), hand - y0.double()) < REL[dtype]
    base = token_slots < 0
    assert base.any() and torch.equal(y[base], y0[base]) and (buf[base] == 0).all()
    _expand_skips_base_rows(lo.sgmv_expand, lo.sgmv_expand_ref, y0, b, scalings, gen,
                            token_slots, starts, slots)
    # SGMV and BGMV are two layouts of the same map: same answer for the same row -> slot
    y_b = y0.clone()
    lo.add_lora(y_b, x, a, b, token_slots, scalings)
    assert rel_err(y_b - y0, y - y0) < REL[dtype]


def test_sgmv_no_segments_and_all_empty():
    gen = torch.Generator().manual_seed(2)
    a, b, scalings = _adapters(2, 8, 16, 16, torch.float32, gen)
    x, y0 = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    for starts, slots in (([0], []), ([0, 0, 0], [0, 1])):
        starts, slots = torch.tensor(starts), torch.tensor(slots, dtype=torch.long)
        buf = lo.sgmv_shrink(x, a, starts, slots)
        y = y0.clone()
        lo.sgmv_expand(y, buf, b, starts, slots, scalings)
        assert (buf == 0).all() and torch.equal(y, y0)


def test_bad_input_is_named():
    gen = torch.Generator().manual_seed(3)
    a, b, scalings = _adapters(2, 8, 16, 24, torch.float32, gen)
    x, y = torch.randn(3, 16, generator=gen), torch.randn(3, 24, generator=gen)
    buf = torch.zeros(3, 8)
    for fn in (lo.bgmv_shrink, lo.bgmv_shrink_ref):
        with pytest.raises(ValueError, match=r"-1 \(no adapter\) or a slot in \[0, 2\)"):
            fn(x, a, torch.tensor([0, 2, -1]))
        with pytest.raises(ValueError, match="lora_a must be"):
            fn(x[:, :8], a, torch.tensor([0, 1, -1]))
    for fn in (lo.bgmv_expand, lo.bgmv_expand_ref):
        with pytest.raises(ValueError, match="lora_b must be"):
            fn(y[:, :8], buf, b, torch.tensor([0, 1, -1]), scalings)
        with pytest.raises(ValueError, match="scalings must be"):
            fn(y, buf, b, torch.tensor([0, 1, -1]), scalings[:1])
    for fn in (lo.sgmv_shrink, lo.sgmv_shrink_ref):
        with pytest.raises(ValueError, match="seg_starts must rise"):
            fn(x, a, torch.tensor([0, 2, 1]), torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="seg_starts must rise"):
            fn(x, a, torch.tensor([0, 4]), torch.tensor([0]))  # past T = 3
        with pytest.raises(ValueError, match="seg_slots must be 1-D with 2 entries"):
            fn(x, a, torch.tensor([0, 1, 3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_seg_len 1 < the longest segment 2"):
        lo.sgmv_shrink(x, a, torch.tensor([0, 2]), torch.tensor([0]), max_seg_len=1)
    with pytest.raises(ValueError, match="lora_a must have x's dtype"):
        lo.bgmv_shrink(x, a.double(), torch.tensor([0, 1, -1]))
