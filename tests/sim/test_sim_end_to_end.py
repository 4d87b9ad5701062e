"""The cost model and metrics through the engine's simulator, against hand-composed step times."""

import pytest

from labkit.sim.cost import attention_pairs, step_time
from labkit.sim.simulate import simulate
from labkit.sim.workloads import RequestSpec


def test_single_request_timeline_is_the_roofline():
    # One 100-token prompt, 5 output tokens: one prefill step (which samples the first token),
    # then 4 decode steps at positions 100..103.
    res = simulate(workload=[RequestSpec(100, 5, 0.0)], enable_prefix_caching=False)
    m = res.metrics
    prefill = step_time("llama-2-7b", "a100-80gb", 100, 0, 0,
                        attention_pairs=attention_pairs(0, 100))
    decodes = [step_time("llama-2-7b", "a100-80gb", 0, 1, p, attention_pairs=attention_pairs(p, 1))
               for p in range(100, 104)]
    assert m["ttft"]["mean"] == pytest.approx(prefill, rel=1e-9)
    assert m["e2e"]["mean"] == pytest.approx(prefill + sum(decodes), rel=1e-9)
    assert m["tpot"]["mean"] == pytest.approx(sum(decodes) / 4, rel=1e-9)
    s = sorted(decodes)  # the four inter-token gaps; P50 of four = mean of the middle two
    assert m["itl"]["p50"] == pytest.approx((s[1] + s[2]) / 2, rel=1e-9)
    assert m["queue"]["mean"] == 0.0
    assert m["output_tokens"] == 5


def test_batching_two_requests_shares_the_weight_read():
    # Two identical requests decode together: each decode step costs one weight read, so the
    # pair finishes in much less than twice one request's time.
    one = simulate(workload=[RequestSpec(64, 32, 0.0)], enable_prefix_caching=False)
    two = simulate(workload=[RequestSpec(64, 32, 0.0, seed=1), RequestSpec(64, 32, 0.0, seed=2)],
                   enable_prefix_caching=False)
    assert two.metrics["duration_s"] < 1.1 * one.metrics["duration_s"]
    assert two.metrics["tokens_per_s"] > 1.8 * one.metrics["tokens_per_s"]
