"""fused_moe (Triton, under the interpreter) against the loop over experts, and the alignment's
bookkeeping against a hand-computed case."""

import pytest
import torch
import torch.nn.functional as F
from labkit.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align_block_size

REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_align_hand_computed():
    # T=3, k=2, E=5 (expert 3 gets nothing), block 4. Pairs t*k+j: experts [2,0, 0,4, 2,1].
    topk_ids = torch.tensor([[2, 0], [0, 4], [2, 1]])
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, 4, 5)
    P = 6  # pad = T*k
    assert sorted_ids[:16].tolist() == [1, 2, P, P,  5, P, P, P,  0, 4, P, P,  3, P, P, P]
    assert ntpp.tolist() == [16]
    assert expert_ids[:4].tolist() == [0, 1, 2, 4]
    # static length: 6 pairs + min(5, 6) non-empty experts * 3 pad rows = 21 -> 6 blocks
    assert sorted_ids.numel() == 21 and (sorted_ids[16:] == P).all()
    assert expert_ids.tolist()[4:] == [-1, -1]


@pytest.mark.parametrize("t,k,e,bs", [(7, 2, 5, 4), (1, 1, 3, 16), (13, 3, 8, 2), (4, 2, 64, 16)])
def test_align_invariants(t, k, e, bs):
    gen = torch.Generator().manual_seed(t * 100 + e)
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, bs, e)
    n = int(ntpp)
    flat = topk_ids.reshape(-1)
    assert n % bs == 0
    used = sorted_ids[:n]
    real = used[used < t * k]
    assert sorted(real.tolist()) == list(range(t * k))  # every pair exactly once
    assert (sorted_ids[n:] == t * k).all() and (expert_ids[n // bs:] == -1).all()
    block_expert = expert_ids[:n // bs].repeat_interleave(bs)
    assert (flat[real] == block_expert[used < t * k]).all()  # each pair sits in its expert's block
    assert (expert_ids[:n // bs].diff() >= 0).all()  # one run per expert, ascending
    assert ((used < t * k).view(-1, bs).any(1)).all()  # padding never fills a whole block
    counts = torch.bincount(flat, minlength=e)
    assert n == int(((counts + bs - 1) // bs * bs).sum())  # each run padded to the block size


def _moe_inputs(t, h, i, e, k, dtype, gen, ids=None):
    hidden = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    logits = torch.randn(t, e, generator=gen)
    weights = torch.softmax(logits, -1).gather(1, ids)
    return hidden, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _hand_loop(hidden, w13, w2, weights, ids):
    """Per token, per chosen expert, written out: an independent check of the reference."""
    i = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = F.silu(w13[e, :i].double() @ x) * (w13[e, i:].double() @ x)
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("t,h,i,e,k,config", [
    (5, 32, 24, 4, 2, None),                                   # random routing, k = 2
    (1, 48, 16, 8, 2, None),                                   # a single token (decode)
    (9, 32, 40, 3, 1, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}),  # k = 1, tiles < H, I
    (20, 16, 16, 4, 2, None),                                  # BLOCK_M 64 (prefill config)
])
def test_fused_moe_matches_reference(t, h, i, e, k, config):
    gen = torch.Generator().manual_seed(t + 10 * e)
    args = _moe_inputs(t, h, i, e, k, torch.float32, gen)
    ref = fused_moe_ref(*args)
    out = fused_moe(*args, config=config)
    assert out.shape == (t, h) and out.dtype == torch.float32
    assert rel_err(out, ref) < REL[torch.float32]
    assert rel_err(ref, _hand_loop(*args)) < REL[torch.float32]


def test_empty_experts_and_all_tokens_on_one_expert():
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((6, 1), 2)  # experts 0, 1, 3 get nothing; expert 2 gets every token
    args = _moe_inputs(6, 32, 16, 4, 1, torch.float32, gen, ids=ids)
    out = fused_moe(*args)
    assert rel_err(out, fused_moe_ref(*args)) < REL[torch.float32]
    assert rel_err(out, _hand_loop(*args)) < REL[torch.float32]
    # with every pair on one expert the MoE is that expert's dense MLP times the weight
    hidden, w13, w2, weights, _ = args
    dense = (F.silu(hidden @ w13[2, :16].T) * (hidden @ w13[2, 16:].T)) @ w2[2].T
    assert rel_err(out, dense * weights) < REL[torch.float32]


def test_k2_with_empty_experts():
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[0, 5], [5, 0], [0, 2]])  # of 6 experts, 1, 3 and 4 stay empty
    args = _moe_inputs(3, 32, 16, 6, 2, torch.float32, gen, ids=ids)
    assert rel_err(fused_moe(*args), fused_moe_ref(*args)) < REL[torch.float32]


def test_bf16():
    gen = torch.Generator().manual_seed(5)
    args = _moe_inputs(6, 32, 32, 4, 2, torch.bfloat16, gen)
    out = fused_moe(*args)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, fused_moe_ref(*args)) < REL[torch.bfloat16]


def test_no_tokens():
    gen = torch.Generator().manual_seed(6)
    hidden, w13, w2, _, _ = _moe_inputs(1, 16, 16, 2, 1, torch.float32, gen)
    empty_ids = torch.zeros(0, 2, dtype=torch.long)
    out = fused_moe(hidden[:0], w13, w2, torch.zeros(0, 2), empty_ids)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "topk_ids": a["topk_ids"] + 4}, r"experts in \[0, 4\)"),
    (lambda a: {**a, "w2": a["w2"][:, :, :8]}, "w2 must be"),
    (lambda a: {**a, "w13": a["w13"].double()}, "hidden's dtype"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "shaped like topk_ids"),
    (lambda a: {**a, "hidden": a["hidden"][None]}, r"hidden must be \[T, H\]"),
])
def test_bad_input_is_named(change, match):
    gen = torch.Generator().manual_seed(7)
    names = ("hidden", "w13", "w2", "topk_weights", "topk_ids")
    args = dict(zip(names, _moe_inputs(2, 16, 16, 4, 2, torch.float32, gen)))
    for fn in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError, match=match):
            fn(**change(args))
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two"):
        fused_moe(**args, config={"BLOCK_M": 8})
