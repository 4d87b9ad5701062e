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
    Verdict,
    judge,
)
from labkit.router.canary_cli import add_canary_args, canary_from_args

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
    # after rollback, no new traffic reaches the candidate: the split's weight is 0, and the
    # router's hook overrides a forcing header too
    assert canary.assign(user="anyone") == BASELINE
    assert canary.assign(headers={"X-Labkit-Canary": "candidate"}) == CANDIDATE  # the split
    arm, pool = canary.pick("u", {"X-Labkit-Canary": "candidate"}, ["stable"], ["cand"])
    assert arm == BASELINE and pool == ["stable"]


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


def test_header_accepts_0_and_1():
    s = CanarySplit(0.0)
    assert s.assign(headers={"x-labkit-canary": "1"}) == CANDIDATE
    assert s.assign(headers={"X-LABKIT-CANARY": " 0 "}) == BASELINE
    assert CanarySplit(1.0).assign(user="u", headers={"x-labkit-canary": "false"}) == BASELINE


def test_decide_on_external_summaries_counts_consecutive_failures():
    """The PromQL path hands in summaries; the same thresholds and the same K-in-a-row rule."""
    a = CanaryAnalysis(min_samples=10, threshold=3, max_error_increase=0.05,
                       max_ttft_p99_ratio=1.5)
    base = {"n": 50, "error_rate": 0.01, "ttft_p99": 0.10}
    slow = {"n": 50, "error_rate": 0.01, "ttft_p99": 0.16}
    assert a.decide(base, {**slow, "n": 9}).action == "wait"  # too few candidate samples
    assert a.decide(base, slow, "prometheus").action == "fail"
    assert a.decide(base, {**slow, "ttft_p99": 0.149}).action == "pass"  # resets the streak
    assert [a.decide(base, slow).action for _ in range(3)] == ["fail", "fail", "rollback"]
    assert a.rolled_back and "TTFT p99 0.160s vs baseline 0.100s" in a.checks[-1].reason
    erroring = {"n": 50, "error_rate": 0.07, "ttft_p99": None}  # no successes: no p99
    assert "error rate 0.070" in judge(base, erroring, 0.05, 1.5)[0]
    assert judge(base, {**erroring, "error_rate": 0.059}, 0.05, 1.5) == []


def test_rollback_is_recorded_once_with_reason_and_source():
    c = Canary(CanarySplit(0.5), CanaryAnalysis(min_samples=1, threshold=1))
    c.apply(Verdict("rollback", "TTFT p99 9s vs baseline 1s", source="prometheus"))
    assert c.split.weight == 0 and c.rollback_reason.endswith("(source: prometheus)")
    c.apply(Verdict("rollback", "later", source="router"))
    assert "later" not in c.rollback_reason
    assert c.status()["weight"] == 0 and c.status()["initial_weight"] == 0.5


def test_cli_flags_build_the_canary():
    import argparse

    p = argparse.ArgumentParser()
    add_canary_args(p)
    assert canary_from_args(p.parse_args([])) is None
    c = canary_from_args(p.parse_args(["--canary", "http://127.0.0.1:9", "--canary-weight",
                                       "0.25", "--canary-min-samples", "30",
                                       "--canary-max-ttft-ratio", "2"]))
    assert c.split.weight == 0.25 and c.analysis.min_samples == 30
    assert c.analysis.max_ttft_p99_ratio == 2 and c.promql is None and c.analysis.auto
    c = canary_from_args(p.parse_args(["--canary", "http://127.0.0.1:9", "--canary-prometheus",
                                       "http://127.0.0.1:9090"]))
    assert c.promql.url == "http://127.0.0.1:9090" and not c.analysis.auto
    with pytest.raises(ValueError, match="needs --canary"):
        canary_from_args(p.parse_args(["--canary-prometheus", "http://127.0.0.1:9090"]))
    with pytest.raises(ValueError, match="weight"):
        canary_from_args(p.parse_args(["--canary", "http://x:1", "--canary-weight", "2"]))


def test_promql_loop_falls_back_to_router_counters_when_prometheus_is_down():
    """No Prometheus on that port: every check runs on the router's windows and says so."""
    import asyncio
    import socket

    from labkit.router.prometheus import PromQLCanarySource

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    c = Canary(CanarySplit(0.5), CanaryAnalysis(min_samples=5, threshold=2),
               PromQLCanarySource(dead), interval_s=0.01)
    for _ in range(10):
        c.record(BASELINE, True, 0.05)
        assert c.record(CANDIDATE, False) is None  # auto checks are off: the loop decides
    asyncio.run(asyncio.wait_for(c.promql_loop(), 20))
    assert c.analysis.rolled_back
    assert [v.action for v in c.analysis.checks] == ["fail", "rollback"]
    assert all(v.source.startswith("router (prometheus failed: ConnectError")
               for v in c.analysis.checks)
