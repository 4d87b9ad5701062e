"""Canary selection and analysis on seeded synthetic traffic: a bad candidate is rolled back
within a stated number of its requests, a healthy one is not."""

import random

import numpy as np
import pytest
from scipy import stats

from labkit.router.canary import (
    BASELINE,
    CANDIDATE,
    Canary,
    CanaryAnalysis,
    CanarySplit,
)

# min_samples (100) + interval (25) * (threshold (2) - 1): the earliest possible rollback
ROLLBACK_WITHIN = 150


def drive(canary, candidate_error, candidate_slow, n, seed, base_error=0.01, users=500):
    """n requests from `users` users; TTFT lognormal around 50 ms (sigma 0.5)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        arm = canary.assign(user=f"user-{rng.integers(users)}")
        err = candidate_error if arm == CANDIDATE else base_error
        slow = candidate_slow if arm == CANDIDATE else 1.0
        ok = rng.random() >= err
        canary.record(arm, ok, float(rng.lognormal(np.log(0.05), 0.5)) * slow if ok else None)
    return canary.analysis


@pytest.mark.parametrize("error,slow", [(0.2, 1.0), (0.01, 3.0), (1.0, 1.0)])
def test_bad_candidate_is_rolled_back_quickly(error, slow):
    canary = Canary(CanarySplit(0.2, rng=random.Random(0)), CanaryAnalysis())
    a = drive(canary, error, slow, 3000, seed=1)
    assert a.rolled_back
    assert a.rolled_back_after <= ROLLBACK_WITHIN
    assert canary.split.weight == 0.0
    assert a.checks[-1].action == "rollback" and a.checks[-1].reason
    # after rollback, no new traffic reaches the candidate (except by header)
    assert canary.assign(user="anyone") == BASELINE
    assert canary.assign(headers={"X-Labkit-Canary": "candidate"}) == CANDIDATE


@pytest.mark.parametrize("seed", range(4))
def test_healthy_candidate_is_not_rolled_back(seed):
    canary = Canary(CanarySplit(0.2, rng=random.Random(seed)), CanaryAnalysis())
    a = drive(canary, 0.01, 1.0, 6000, seed=seed, users=3000)
    assert a.seen[CANDIDATE] > 900  # many checks ran
    assert sum(v.action in ("pass", "fail") for v in a.checks) > 20
    assert not a.rolled_back


def test_slightly_slower_within_tolerance_is_kept():
    canary = Canary(CanarySplit(0.3, rng=random.Random(5)), CanaryAnalysis())
    assert not drive(canary, 0.01, 1.1, 5000, seed=5, users=3000).rolled_back


def test_split_weight_sticky_users_and_headers():
    s = CanarySplit(0.25, rng=random.Random(0))
    arms = [s.assign() for _ in range(4000)]
    k = arms.count(CANDIDATE)
    assert stats.binomtest(k, 4000, 0.25).pvalue > 1e-3
    users = [f"u{i}" for i in range(2000)]
    first = {u: s.assign(user=u) for u in users}
    assert all(s.assign(user=u) == first[u] for u in users)  # sticky
    assert stats.binomtest(list(first.values()).count(CANDIDATE), 2000, 0.25).pvalue > 1e-3
    assert s.assign(user="u1", headers={"x-labkit-canary": "baseline"}) == BASELINE
    with pytest.raises(ValueError, match="is not 'baseline' or 'candidate'"):
        s.assign(headers={"x-labkit-canary": "yes"})


def test_analysis_waits_for_min_samples_and_validates():
    a = CanaryAnalysis(min_samples=50, interval=10)
    for _ in range(40):
        a.record(BASELINE, True, 0.05)
        v = a.record(CANDIDATE, False)
    assert v.action == "wait" and not a.rolled_back
    with pytest.raises(ValueError, match="arm must be"):
        a.record("blue", True)
    with pytest.raises(ValueError, match="min_samples"):
        CanaryAnalysis(window=10, min_samples=20)
