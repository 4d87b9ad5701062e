"""The MoE routing exercise on labkit-tiny-moe: the reference solution passes; softmax after
top-k, a dropped renormalisation, a combine that writes rows back in dispatch order, and a
dispatch that does not group by expert are rejected with a message naming the mistake."""

import pytest
import torch

from labkit.exercises import moe_routing as M
from labkit.exercises import moe_routing_solutions as S


def softmax_after_topk(router_logits, top_k, renormalize):
    """Mixtral's code path taken where the model softmaxes first: right only when renormalised."""
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids


def no_renormalisation(router_logits, top_k, renormalize):
    return torch.topk(torch.softmax(router_logits, -1, dtype=torch.float32), top_k, dim=-1)


def combine_in_dispatch_order(expert_out, order, topk_weights, num_tokens):
    """Weights and rows line up, but row i goes to token i // k instead of order[i] // k."""
    k = topk_weights.shape[1]
    w = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, expert_out.shape[1])
    out.index_add_(0, torch.arange(order.numel()) // k, expert_out * w[:, None])
    return out


def combine_weights_unpermuted(expert_out, order, topk_weights, num_tokens):
    """Rows go to the right token, but each takes the weight of slot i, not of slot order[i]."""
    k = topk_weights.shape[1]
    out = torch.zeros(num_tokens, expert_out.shape[1])
    out.index_add_(0, order // k, expert_out * topk_weights.reshape(-1)[:, None])
    return out


def dispatch_unsorted(topk_ids, num_experts):
    flat = topk_ids.reshape(-1)
    return torch.arange(flat.numel()), torch.bincount(flat, minlength=num_experts).tolist()


def test_reference_passes(capsys):
    result = M.check(S.topk_gating, S.dispatch, S.combine)
    assert result.passed, result.message
    assert "all 4 MoE layers of labkit-tiny-moe" in capsys.readouterr().out


def test_softmax_after_topk_agrees_only_with_renormalisation():
    """The teaching point the check relies on, by hand on real router logits."""
    case = M.real_cases()[0]
    logits = case.block.gate(case.x).detach()
    a_w, a_ids = softmax_after_topk(logits, 2, True)
    b_w, b_ids = S.topk_gating(logits, 2, True)
    assert torch.equal(a_ids, b_ids) and torch.allclose(a_w, b_w, atol=1e-6)
    c_w, _ = S.topk_gating(logits, 2, False)
    assert (a_w - c_w).abs().max() > 0.05


@pytest.mark.parametrize("gating,dispatch,combine,words", [
    (softmax_after_topk, S.dispatch, S.combine, ["renormalize=False", "BEFORE top-k"]),
    (no_renormalisation, S.dispatch, S.combine, ["renormalize=True", "sum to 1"]),
    (S.topk_gating, S.dispatch, combine_in_dispatch_order,
     ["does not reproduce the layer's output", "THAT token"]),
    (S.topk_gating, S.dispatch, combine_weights_unpermuted,
     ["does not reproduce the layer's output"]),
    (S.topk_gating, dispatch_unsorted, S.combine, ["not grouped by expert"]),
], ids=["softmax-after-topk", "no-renorm", "combine-order", "combine-weights", "unsorted"])
def test_wrong_answers_rejected(gating, dispatch, combine, words):
    result = M.check(gating, dispatch, combine)
    assert not result.passed
    for w in words:
        assert w in result.message, result.message


def test_untouched_stub_is_not_an_attempt():
    def stub(*a):
        raise NotImplementedError("write topk_gating")
    result = M.check(stub, S.dispatch, S.combine)
    assert not result.passed and "not implemented yet" in result.message
