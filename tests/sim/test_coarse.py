"""Coarse tokens: scale 1 is the simulator itself; larger scales track it on fleet metrics."""

import numpy as np
import pytest

from labkit.router.policies import RoundRobin
from labkit.sim.coarse import add_coarse_request, coarse_engine
from labkit.sim.fleet import Fleet, FleetConfig
from labkit.sim.simulate import simulate
from labkit.sim.traces import poisson_trace
from labkit.sim.workloads import get_workload


def run_engine(engine, specs):
    for i, s in enumerate(specs):
        add_coarse_request(engine, f"r{i}", s, s.arrival_time)
    while engine.has_unfinished_requests():
        engine.step()
    return {t["request_id"]: t for t in engine.request_timings()}


def test_scale_one_is_exactly_the_simulator():
    specs = get_workload("shared-prefix", num_groups=3, prefix_len=256, suffix_min=8,
                         suffix_max=200, output_min=4, output_max=64).sample(40, 1, 30.0)
    ref = simulate(model="llama-3-8b", gpu="h100-sxm", workload=specs, record_trace=False)
    got = run_engine(coarse_engine("llama-3-8b", "h100-sxm", scale=1), specs)
    for t in ref.timings:
        g = got[t["request_id"]]
        assert g["first_token_time"] == pytest.approx(t["first_token_time"], abs=1e-12)
        assert g["finish_time"] == pytest.approx(t["finish_time"], abs=1e-12)
        assert g["num_cached_tokens"] == t["num_cached_tokens"]


def test_prompt_and_output_lengths_scale():
    specs = get_workload("fixed", prompt_len=100, output_len=33).sample(2, 0)
    eng = coarse_engine("llama-3-8b", "h100-sxm", scale=4)
    run_engine(eng, specs)
    assert eng.block_size == 4
    for req in eng.requests.values():
        assert req.prompt_len == 25 and req.seqs[0].num_output_tokens == 9  # ceil(33 / 4)


def test_bad_scale_is_named():
    with pytest.raises(ValueError, match="divide block_size"):
        coarse_engine("llama-3-8b", "h100-sxm", scale=3)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [40, 100])
def test_scale_four_tracks_scale_one(rate):
    # one replica at light load and near its knee (~100 req/s here)
    tr = poisson_trace(rate=rate, duration=3, num_tenants=8, seed=3)
    a, b = (Fleet(RoundRobin(), 1, FleetConfig(token_scale=k)).run(tr.specs, tr.duration)
            for k in (1, 4))
    assert abs(a.hit_rate - b.hit_rate) < 0.015
    assert b.replica_seconds == pytest.approx(a.replica_seconds, rel=0.03)
    for q in (50, 90, 99):  # within 20 ms + 15%: the coarse step's granularity, not queueing
        ta, tb = np.percentile(a.ttfts(), q), np.percentile(b.ttfts(), q)
        assert abs(tb - ta) < 0.02 + 0.15 * ta, (q, ta, tb)
    e2e_a = np.median([r["e2e"] for r in a.requests])
    assert np.median([r["e2e"] for r in b.requests]) == pytest.approx(e2e_a, rel=0.05)
