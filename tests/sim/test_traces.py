"""Multi-tenant traces: thinning draws the intended Poisson process, tenants follow Zipf."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from labkit.sim.presets import cold_start_s, get_model_preset
from labkit.sim.traces import bursty_day, diurnal, make_tenants, poisson_trace, thinning


def test_thinning_passes_the_time_rescaling_test():
    # Time-rescaling theorem: for a Poisson process with intensity rate(t), the increments of
    # Lambda(t_i) = integral of rate up to t_i are i.i.d. Exp(1).
    rate = diurnal(100.0, 50.0, 0.2)
    t = thinning(rate, 50.0, 100.0, np.random.default_rng(0))
    lam = np.array([integrate.quad(rate, 0, x)[0] for x in t])
    assert stats.kstest(np.diff(np.concatenate([[0.0], lam])), "expon").pvalue > 1e-3
    expected = integrate.quad(rate, 0, 100.0)[0]
    assert abs(len(t) - expected) < 4 * math.sqrt(expected)
    with pytest.raises(ValueError, match="exceeds rate_max"):
        thinning(rate, 10.0, 100.0, np.random.default_rng(0))


def test_diurnal_shape():
    r = diurnal(240.0, 100.0, 0.25)
    assert r(40.0) == pytest.approx(25.0)  # 04:00 of a 240 s day: the trough
    assert r(160.0) == pytest.approx(100.0)  # 16:00: the peak


def test_tenants_and_requests():
    ts = make_tenants(16, seed=1)
    assert sum(t.share for t in ts) == pytest.approx(1.0)
    assert ts[0].share / ts[1].share == pytest.approx(2.0)  # Zipf s=1: share 1/rank
    assert all(t.system_len % 16 == 0 and 256 <= t.system_len <= 2048 for t in ts)
    tr = poisson_trace(40.0, 50.0, num_tenants=16, seed=1)
    groups = [s.prefix_group for s in tr.specs]
    top = max(set(groups), key=groups.count)
    assert groups.count(top) / len(groups) == pytest.approx(ts[0].share, abs=0.05)
    a, b = [s for s in tr.specs if s.prefix_group == top][:2]
    ia, ib = a.prompt_token_ids(128256), b.prompt_token_ids(128256)
    assert ia[: a.prefix_len] == ib[: b.prefix_len] and ia[a.prefix_len:] != ib[b.prefix_len:]


def test_bursty_day_has_its_bursts():
    tr = bursty_day(200.0, 30.0, num_bursts=2, burst_factor=2.0, burst_s=10.0, seed=2)
    b = tr.meta["bursts"][0]
    t = np.array([s.arrival_time for s in tr.specs])
    inside = np.sum((t >= b["start"]) & (t < b["start"] + 10))
    expected = integrate.quad(tr.rate, b["start"], b["start"] + 10, limit=200)[0]
    assert expected > 1.5 * integrate.quad(diurnal(200.0, 30.0), b["start"],
                                           b["start"] + 10)[0]
    assert abs(inside - expected) < 4 * math.sqrt(expected)


def test_cold_start_hand_computed():
    w = get_model_preset("llama-3-8b").weight_bytes  # 16.06 GB
    assert cold_start_s("llama-3-8b", "h100", "nvme-gen4", init_s=20) == pytest.approx(
        20 + w / 7.45e9)
    # the slower of storage and host link: 100 GbE (12.5 GB/s) under the H100 host link (50)
    assert cold_start_s("llama-3-8b", "h100", "network-100gbe", 0) == pytest.approx(w / 12.5e9)
    # 10 GbE on an A100: the network is the bottleneck
    assert cold_start_s("llama-3-8b", "a100", "network-10gbe", 0) == pytest.approx(w / 1.25e9)
    with pytest.raises(ValueError, match="valid names"):
        cold_start_s("llama-3-8b", "h100", "floppy")
