"""Workloads: seeded, statistically on target, with the distribution files self-consistent."""

import math

import numpy as np
import pytest
from scipy import stats

from labkit.sim.workloads import (
    RequestSpec,
    clipped_lognormal_mean,
    fit_lognormal_mu,
    get_workload,
    load_length_file,
    load_prompt_set,
    prompt_texts,
)


def _lens(reqs):
    return (np.array([r.prompt_len for r in reqs]), np.array([r.output_len for r in reqs]))


@pytest.mark.parametrize("name,prompt_mean,output_mean", [("chat", 161.31, 337.99),
                                                          ("alpaca", 19.31, 58.45)])
def test_means_match_paper(name, prompt_mean, output_mean):
    p, o = _lens(get_workload(name).sample(20_000, seed=1))
    # Standard error of the mean is sd/sqrt(n); allow 4 standard errors.
    assert abs(p.mean() - prompt_mean) < 4 * p.std() / math.sqrt(len(p))
    assert abs(o.mean() - output_mean) < 4 * o.std() / math.sqrt(len(o))


def test_chat_is_long_tailed_and_clipped():
    p, o = _lens(get_workload("chat").sample(20_000, seed=2))
    assert np.median(p) < 0.8 * p.mean()  # right-skewed: median well under the mean
    assert np.percentile(p, 99) > 4 * p.mean()
    assert p.min() >= 1 and p.max() <= 1024 and o.max() <= 1024


def test_chat_log_lengths_are_normal_inside_clip():
    # Unclipped interior of a lognormal: log-lengths follow N(mu, sigma). KS test on the
    # middle 90%, compared with the truncated normal.
    spec = load_length_file("chat")["prompt"]
    p, _ = _lens(get_workload("chat").sample(5_000, seed=3))
    x = np.log(p[(p > 20) & (p < 800)])
    mu, s = spec["mu"], spec["sigma"]
    a, b = (np.log(20.5) - mu) / s, (np.log(799.5) - mu) / s
    res = stats.kstest(x, stats.truncnorm(a, b, loc=mu, scale=s).cdf)
    assert res.pvalue > 1e-3


@pytest.mark.parametrize("name", ["chat", "alpaca"])
def test_length_files_mu_is_the_fit(name):
    spec = load_length_file(name)
    assert "SOSP 2023" in spec["source"]
    for part in ("prompt", "output"):
        d = spec[part]
        assert d["mu"] == pytest.approx(fit_lognormal_mu(d["mean"], d["sigma"], d["min"], d["max"]),
                                        abs=1e-5)


def test_clipped_lognormal_mean_against_monte_carlo():
    rng = np.random.default_rng(0)
    x = np.clip(rng.lognormal(4.0, 1.2, 400_000), 1, 500)
    assert clipped_lognormal_mean(4.0, 1.2, 1, 500) == pytest.approx(x.mean(), rel=5e-3)
    # No clipping in effect: the plain lognormal mean.
    assert clipped_lognormal_mean(1.0, 0.5, 1e-9, 1e9) == pytest.approx(math.exp(1.125))


def test_fixed_and_uniform():
    reqs = get_workload("fixed", prompt_len=7, output_len=9).sample(5, seed=0)
    assert all(r.prompt_len == 7 and r.output_len == 9 and r.arrival_time == 0 for r in reqs)
    p, o = _lens(get_workload("uniform", prompt_min=10, prompt_max=20, output_min=1,
                              output_max=3).sample(3000, seed=0))
    assert p.min() == 10 and p.max() == 20 and set(o) == {1, 2, 3}
    assert abs(p.mean() - 15) < 0.3


def test_seeded_determinism():
    a = get_workload("chat").sample(50, seed=7, arrival_rate=2.0)
    b = get_workload("chat").sample(50, seed=7, arrival_rate=2.0)
    c = get_workload("chat").sample(50, seed=8, arrival_rate=2.0)
    assert a == b and a != c


def test_poisson_arrivals():
    reqs = get_workload("fixed").sample(4000, seed=0, arrival_rate=5.0)
    t = np.array([r.arrival_time for r in reqs])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps > 0)
    assert abs(gaps.mean() - 0.2) < 4 * 0.2 / math.sqrt(len(gaps))
    # Exponential gaps: KS test against Exp(rate).
    assert stats.kstest(gaps, stats.expon(scale=0.2).cdf).pvalue > 1e-3


def test_shared_prefix_groups_share_tokens():
    wl = get_workload("shared-prefix", num_groups=2, prefix_len=32, suffix_min=4, suffix_max=8)
    reqs = wl.sample(40, seed=0)
    assert all(36 <= r.prompt_len <= 40 and r.prefix_len == 32 for r in reqs)
    assert {r.prefix_group for r in reqs} == {0, 1}
    ids = [r.prompt_token_ids(vocab_size=100) for r in reqs]
    assert all(len(t) == r.prompt_len for t, r in zip(ids, reqs))
    assert all(3 <= x < 100 for t in ids for x in t)
    same = [t for t, r in zip(ids, reqs) if r.prefix_group == reqs[0].prefix_group]
    other = [t for t, r in zip(ids, reqs) if r.prefix_group != reqs[0].prefix_group]
    assert all(t[:32] == same[0][:32] for t in same)
    assert other[0][:32] != same[0][:32]
    assert same[0][32:] != same[1][32:]  # suffixes are unique per request


def test_synthetic_ids_unique_without_prefix():
    a, b = get_workload("fixed", prompt_len=16).sample(2, seed=0)
    assert a.prompt_token_ids() != b.prompt_token_ids()
    assert RequestSpec(4, 1, 0.0, seed=5).prompt_token_ids() == \
        RequestSpec(4, 1, 0.0, seed=5).prompt_token_ids()


def test_bad_input():
    with pytest.raises(ValueError, match="valid names"):
        get_workload("nope")
    with pytest.raises(ValueError, match="arrival_rate"):
        get_workload("fixed").sample(3, seed=0, arrival_rate=0)
    with pytest.raises(ValueError, match="prompt"):
        get_workload("uniform", prompt_min=5, prompt_max=4)
    with pytest.raises(ValueError, match="available"):
        load_prompt_set("nope")


def test_prompt_sets():
    code = prompt_texts("code_prompts")
    assert len(code) >= 32 and all(isinstance(p, str) and p for p in code)
    chat = load_prompt_set("chat_prompts")
    texts = prompt_texts("chat_prompts")
    system = chat[0]["system"]
    assert all(r["system"] == system for r in chat)
    # The shared system prompt is most of each prompt: the case prefix caching targets.
    assert all(t.startswith(system) and len(system) >= len(t) / 2 for t in texts)


def test_parametric_lognormal_mean_and_spread():
    fixed = get_workload("lognormal", prompt_mean=50, output_mean=100, output_sigma=0.0)
    p, o = _lens(fixed.sample(100, seed=0))
    assert set(p) == {50} and set(o) == {100}
    wide = get_workload("lognormal", output_mean=100, output_sigma=1.0, max_output_len=2000)
    _, o = _lens(wide.sample(20_000, seed=0))
    assert abs(o.mean() - 100) < 4 * o.std() / math.sqrt(len(o))
    # Coefficient of variation of a lognormal: sqrt(exp(sigma^2) - 1) = 1.31 (clip trims it).
    assert 1.0 < o.std() / o.mean() < 1.35
    with pytest.raises(ValueError, match="sigma"):
        get_workload("lognormal", output_sigma=-1)
    with pytest.raises(ValueError, match="mean length"):
        get_workload("lognormal", output_mean=0, output_sigma=0.0)
    with pytest.raises(ValueError, match="must lie in"):
        get_workload("lognormal", output_mean=5000, max_output_len=1024)
