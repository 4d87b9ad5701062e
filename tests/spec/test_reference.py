"""The standalone speculative_generate, the n-gram lookup and the theory formulas."""

from __future__ import annotations

import pytest
import torch

from labkit.model.generate import generate
from labkit.spec.proposers import NgramProposer
from labkit.spec.theory import (
    acceptance_stats,
    alpha_needed,
    cpu_speedup,
    expected_speedup,
    expected_tokens_per_step,
    speculative_generate,
)

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 17, 3], list(range(10, 40)), [7] * 5 + [8, 9]]


def test_ngram_lookup_hand_computed():
    ng = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    # suffix [2, 3] occurred at 1..2, followed by 4, 5, 6
    assert ng.lookup([1, 2, 3, 4, 5, 6, 9, 2, 3], 3) == [4, 5, 6]
    # the longest n wins: [9, 2, 3] matched at 6..8 beats the 1-gram [3] elsewhere
    assert ng.lookup([9, 2, 3, 7, 3, 8, 9, 2, 3, 1, 1, 9, 2, 3], 2) == [1, 1]
    # the most recent match with a full continuation is preferred
    assert ng.lookup([5, 1, 5, 2, 5, 3, 5], 1) == [3]
    assert ng.lookup([1, 2, 3, 1, 2, 9, 1, 2], 3) == [9, 1, 2]
    # no match has γ tokens after it: the earliest (longest continuation) is used
    one = NgramProposer(5, prompt_lookup_max=1)
    assert one.lookup([9, 9, 9, 4, 4, 4, 4, 4], 5) == [4, 4, 4, 4]  # not [4] from the latest
    assert ng.lookup([4, 4, 4, 4], 3) == [4]  # the 3-gram at 0 wins over shorter n-grams
    assert ng.lookup([1, 2, 3], 2) == []  # nothing repeats
    assert ng.lookup([1, 2, 3, 1], 0) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, prompt_lookup_max=1, prompt_lookup_min=2)


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["noisy", "small", "self", "ngram"])
def test_greedy_reference_equals_plain_greedy(target, drafts, draft_name, gamma):
    draft = NgramProposer(gamma, 4, 1) if draft_name == "ngram" else drafts[draft_name]
    for prompt in PROMPTS:
        want = generate(target, prompt, 40, ignore_eos=True)
        got, records = speculative_generate(target, draft, prompt, 40, gamma, ignore_eos=True)
        assert got == want
        stats = acceptance_stats(records)
        if draft_name == "self":  # the target drafting for itself is always right
            assert stats.acceptance_rate == 1.0


def test_reference_accepts_something(target, drafts):
    """The noisy draft is close enough that speculation actually skips target steps."""
    prompt = PROMPTS[1]
    _, records = speculative_generate(target, drafts["noisy"], prompt, 60, 4, ignore_eos=True)
    s = acceptance_stats(records)
    assert 0.0 < s.acceptance_rate < 1.0
    assert len(records) < 60  # fewer target forwards than tokens


def test_sampled_first_token_equals_plain_seeded_sampling(target, drafts):
    """The prefill token is plain sampling: same generator draw as generate's."""
    for seed in range(5):
        want = generate(target, PROMPTS[0], 1, temperature=1.0, seed=seed)
        got, _ = speculative_generate(target, drafts["small"], PROMPTS[0], 1, 3,
                                      temperature=1.0, seed=seed)
        assert got == want


def test_stops_on_eos_and_max_tokens(target, drafts):
    out = generate(target, PROMPTS[1], 30, ignore_eos=True)
    stop = out[7]
    want = generate(target, PROMPTS[1], 30, stop_token_ids=[stop], ignore_eos=True)
    got, _ = speculative_generate(target, drafts["self"], PROMPTS[1], 30, 5,
                                  stop_token_ids=[stop], ignore_eos=True)
    assert got == want and got[-1] == stop
    got, _ = speculative_generate(target, drafts["self"], PROMPTS[1], 9, 5, ignore_eos=True)
    assert got == out[:9]


def test_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(None, NgramProposer(1), [1], 4, gamma=0)


def test_theory_formulas():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)
    # the CPU model: with verify = one decode and no overhead it is the textbook formula
    assert cpu_speedup(0.7, 3, 0.2, 1.0) == pytest.approx(expected_speedup(0.7, 3, 0.2))
    assert cpu_speedup(0.5, 2, 0.25, 1.4, 0.2) == pytest.approx(1.75 * 1.2 / (0.5 + 1.4 + 0.2))
    assert alpha_needed(1.5, 1, 0.0, 1.0) == pytest.approx(0.5)  # 1 + α = 1.5
    # 1 + α + α² = 1.5 · 1.5  ->  α = (√6 − 1) / 2
    assert alpha_needed(1.5, 2, 0.25, 1.0) == pytest.approx((6 ** 0.5 - 1) / 2)
    assert alpha_needed(3.5, 2, 0.0, 1.0) is None  # never more than γ + 1 tokens per step


def test_acceptance_stats_match_simulated_geometric():
    """α estimated from records of a simulated iid acceptance process recovers α."""
    gen = torch.Generator().manual_seed(0)
    alpha, gamma = 0.7, 4
    records = []
    for _ in range(20_000):
        u = torch.rand(gamma, generator=gen) < alpha
        k = int(u.long().cumprod(0).sum())
        records.append((gamma, k))
    s = acceptance_stats(records)
    assert s.alpha == pytest.approx(alpha, abs=0.01)
    assert all(a == pytest.approx(alpha, abs=0.02) for a in s.alpha_per_position)
    assert s.mean_accepted + 1 == pytest.approx(expected_tokens_per_step(alpha, gamma), abs=0.03)
    # hand-computed: accepted 2 of 3 reaches positions 0,1,2, accepts 0,1
    h = acceptance_stats([(3, 2), (3, 0), (0, 0)])
    assert (h.reached, h.accepted_at, h.num_steps) == ([2, 1, 1], [1, 1, 0], 2)
