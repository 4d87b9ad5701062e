"""The knee beside the simulator (labkit.bench.serve_knee): the step-time fit recovers a known
line, and the simulated sweep on a fitted clock gives hand-computed capacities and TTFTs."""

from __future__ import annotations

import math

import pytest

from labkit.bench.serve_knee import fit_step_time, knee_report, simulate_rate

A = {"a_s": 0.01, "per_token_s": 0.0, "per_seq_s": 0.0}  # every step 10 ms
KW = {"vocab_size": 128, "max_num_seqs": 4, "num_blocks": 64, "block_size": 4,
      "max_model_len": 64}


def _step(tokens, seqs, duration):
    return {"num_batched_tokens": tokens, "scheduled": [{}] * seqs, "duration": duration}


def test_fit_recovers_a_known_line():
    steps = [_step(t, s, 0.002 + 1e-5 * t + 3e-4 * s)
             for t, s in [(1, 1), (40, 2), (7, 7), (300, 3), (16, 16), (90, 1), (5, 5)]]
    steps.append(_step(0, 0, 0.5))  # an idle step: ignored
    fit = fit_step_time(steps)
    assert fit["a_s"] == pytest.approx(0.002, abs=1e-9)
    assert fit["per_token_s"] == pytest.approx(1e-5, abs=1e-10)
    assert fit["per_seq_s"] == pytest.approx(3e-4, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0) and fit["num_steps"] == 7
    with pytest.raises(ValueError, match="at least 3"):
        fit_step_time(steps[:2])


def test_all_at_once_capacity_is_hand_computed():
    """8 requests of 5 prompt + 6 output tokens at t=0, 4 slots: two waves of 1 prefill step
    (the first token) + 5 decode steps, 10 ms each -> 120 ms; TTFT 10 ms (first wave) and 70 ms
    (second wave, prefilled once the first wave's slots are free)."""
    prompts = [[1 + i] * 5 for i in range(8)]
    r = simulate_rate(A, prompts, [6] * 8, math.inf, **KW)
    assert r["request_throughput"] == pytest.approx(8 / 0.120)
    assert r["output_throughput"] == pytest.approx(48 / 0.120)
    assert r["median_ttft_ms"] == pytest.approx((10 + 70) / 2)
    assert r["median_tpot_ms"] == pytest.approx(10.0)


def test_far_below_capacity_ttft_is_one_step():
    prompts = [[1 + i % 50] * 5 for i in range(40)]
    r = simulate_rate(A, prompts, [6] * 40, 1.0, seed=3, **KW)  # 1 req/s vs ~67 req/s capacity
    assert r["median_ttft_ms"] == pytest.approx(10.0)
    assert r["p99_ttft_ms"] <= 20.0 + 1e-9  # at worst it waits for the step in flight
    assert r["request_throughput"] < 1.5


def test_knee_report_ratio():
    measured = [{"request_throughput": 2.0}, {"request_throughput": 2.9}]
    simulated = [{"request_throughput": 3.0}, {"request_throughput": 5.8}]
    k = knee_report(measured, simulated, A)
    assert k["measured_capacity_req_s"] == 2.9 and k["simulated_capacity_req_s"] == 5.8
    assert k["measured_over_simulated"] == pytest.approx(0.5) and k["step_fit"] is A
