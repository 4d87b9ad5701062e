"""Exactness of speculative sampling on synthetic p / q pairs, tested statistically.

Each case runs many seeded speculative steps and checks, with a chi-square goodness-of-fit test,
that the first two emitted tokens are distributed as p ⊗ p (the target sampled twice, which is what
plain sampling from a position-independent target does). Significance level: 0.001 per test; a
fixed seed makes each test deterministic, never flaky. Negative controls run wrong rules through
the same harness and must be rejected with p-value < 1e-6, which shows the test has power.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from labkit.spec.rejection import SpecVerifyError, rejection_sample, verify, verify_greedy

SIGNIFICANCE = 1e-3
TRIALS = 8_000

Rule = Callable[[list[int], torch.Tensor | None, torch.Tensor, torch.Generator],
                tuple[list[int], int]]


def _always_accept(drafts, q, p, gen):
    last = int(torch.multinomial(p[len(drafts)], 1, generator=gen))
    return list(drafts) + [last], len(drafts)


def _resample_from_p(drafts, q, p, gen):
    """Correct accept test, but on rejection samples p instead of the residual max(0, p - q)."""
    emitted, k = rejection_sample(drafts, q, p, gen)
    if k < len(drafts):
        emitted[-1] = int(torch.multinomial(p[k], 1, generator=gen))
    return emitted, k


def _two_tokens(rule: Rule, p: torch.Tensor, q: torch.Tensor | None, gamma: int,
                draft_token: int | None, trials: int, seed: int) -> torch.Tensor:
    """Run speculative steps until two tokens are emitted; return [trials, 2] token ids."""
    gen = torch.Generator().manual_seed(seed)
    target = p.expand(gamma + 1, -1)
    draft = None if q is None else q.expand(gamma, -1)
    out = torch.empty(trials, 2, dtype=torch.long)
    for t in range(trials):
        stream: list[int] = []
        while len(stream) < 2:
            if q is None:  # n-gram style point-mass draft
                drafts = [draft_token] * gamma
            else:
                drafts = torch.multinomial(q, gamma, replacement=True, generator=gen).tolist()
            emitted, k = rule(drafts, draft, target, gen)
            assert len(emitted) == k + 1
            stream += emitted
        out[t] = torch.tensor(stream[:2])
    return out


def _chisq(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (renormalised)."""
    probs = probs.double() / probs.double().sum()
    return float(chisquare(counts.double().numpy(), (probs * counts.sum()).numpy()).pvalue)


def _pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of the joint (token0, token1) counts against p ⊗ p on p's support."""
    v = p.numel()
    joint = torch.outer(p, p).flatten().double()
    counts = torch.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v).double()
    support = joint > 0
    # tokens outside p's support must never be emitted: that is an exact, not statistical, check
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    assert (joint[support] * len(samples)).min() >= 5, "test design: too few expected counts"
    return _chisq(counts[support], joint[support])


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


CASES = {
    # name: (p, q)
    "overlapping": (_dist([5, 3, 2, 4, 1, 5]), _dist([1, 4, 4, 1, 5, 1])),
    "q_mass_where_p_has_none": (_dist([0, 0, 3, 4, 2, 1]), _dist([6, 3, 1, 0.5, 0.2, 0.1])),
    "p_mass_where_q_has_none": (_dist([2, 3, 1, 4, 2, 3]), _dist([0, 0, 1, 5, 0, 1])),
    "identical": (_dist([1, 2, 3, 4, 5, 6]), _dist([1, 2, 3, 4, 5, 6])),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("gamma", [1, 3])
def test_emitted_tokens_follow_target(name, gamma):
    p, q = CASES[name]
    samples = _two_tokens(rejection_sample, p, q, gamma, None, TRIALS, seed=gamma)
    assert _pvalue(samples, p) > SIGNIFICANCE


@pytest.mark.parametrize("draft_token", [0, 3])
def test_point_mass_ngram_draft(draft_token):
    p = _dist([0, 2, 3, 4, 2, 1])  # draft_token 0 has p = 0: always rejected
    samples = _two_tokens(rejection_sample, p, None, 2, draft_token, TRIALS, seed=7)
    assert _pvalue(samples, p) > SIGNIFICANCE


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7), (5, 0.8)])
def test_filtered_p_and_q(top_k, top_p):
    """p and q both come from apply_sampling_filters with the same temperature / top-k / top-p."""
    from labkit.model.sampling import apply_sampling_filters

    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(8, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(8, generator=gen) * 1.5
    p = apply_sampling_filters(target_logits, 0.9, top_k, top_p)
    q = apply_sampling_filters(draft_logits, 0.9, top_k, top_p)
    assert (p == 0).any() and (p > 0).sum() >= 2  # the filters really cut something
    samples = _two_tokens(rejection_sample, p, q, 3, None, TRIALS, seed=11)
    assert _pvalue(samples, p) > SIGNIFICANCE


@pytest.mark.parametrize("wrong_rule", [_always_accept, _resample_from_p])
def test_negative_control_wrong_rules_fail(wrong_rule):
    p, q = CASES["q_mass_where_p_has_none"]
    samples = _two_tokens(wrong_rule, p, q, 2, None, TRIALS, seed=5)
    v = p.numel()
    if wrong_rule is _always_accept:  # emits q's tokens that p forbids: the exact check fires
        with pytest.raises(AssertionError, match="probability 0"):
            _pvalue(samples, p)
        return
    joint = torch.outer(p, p).flatten().double()
    counts = torch.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v).double()
    s = joint > 0
    assert _chisq(counts[s], joint[s]) < 1e-6


def test_negative_control_always_accept_same_support():
    """Always-accept fails the chi-square even when q and p share a support."""
    p, q = CASES["overlapping"]
    samples = _two_tokens(_always_accept, p, q, 2, None, TRIALS, seed=5)
    v = p.numel()
    counts = torch.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v).double()
    assert _chisq(counts, torch.outer(p, p).flatten()) < 1e-6


def test_seeded_determinism():
    p, q = CASES["overlapping"]
    a = _two_tokens(rejection_sample, p, q, 3, None, 200, seed=42)
    b = _two_tokens(rejection_sample, p, q, 3, None, 200, seed=42)
    c = _two_tokens(rejection_sample, p, q, 3, None, 200, seed=43)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_greedy_acceptance_hand_computed():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    # argmax per row: 1, 0, 2, 1
    assert verify_greedy([1, 0, 2], logits) == ([1, 0, 2, 1], 3)  # all accepted + bonus
    assert verify_greedy([1, 2, 2], logits) == ([1, 0], 1)  # correction at the first mismatch
    assert verify_greedy([0, 0, 2], logits) == ([1], 0)
    assert verify_greedy([], logits[:1]) == ([1], 0)  # no drafts: plain greedy step
    assert verify([1, 2, 2], None, logits, temperature=0.0) == ([1, 0], 1)


def test_rejection_hand_computed_extremes():
    gen = torch.Generator().manual_seed(0)
    onehot = torch.eye(4)
    # the target is certain: p(x) = 1 accepts every matching draft, mismatches always rejected
    p = onehot[[2, 3, 1]]
    assert rejection_sample([2, 3], None, p, gen) == ([2, 3, 1], 2)
    assert rejection_sample([2, 0], None, p, gen) == ([2, 3], 1)
    q = torch.full((2, 4), 0.25)
    assert rejection_sample([1, 3], q, p, gen) == ([2], 0)


def test_bad_shapes_raise():
    with pytest.raises(SpecVerifyError, match=r"\[γ\+1, V\]"):
        verify_greedy([1, 2], torch.zeros(2, 5))
    with pytest.raises(SpecVerifyError, match="draft_probs"):
        rejection_sample([1, 2], torch.zeros(3, 5), torch.zeros(3, 5))
