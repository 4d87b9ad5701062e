"""``labkit bench serve``'s noisy neighbour, in miniature: the heavy tenant's rate is calibrated
from the capacity the fcfs server measured in the same run (so it overloads a fast machine as
it does a slow one), the light tenant sends a tenth of it, and every request of both tenants,
under both policies, is answered. Ratios are timings and are not asserted (benchmarks show
them); the calibration and the bookkeeping are."""

from __future__ import annotations

import pytest

from labkit.bench.serve import QUICK
from labkit.bench.serve_fairness import fairness


@pytest.mark.slow
def test_fairness_calibrates_heavy_rate_to_measured_capacity():
    cfg = {**QUICK, "light_n": 2, "heavy_mult": 10, "overload": 2.0, "fair_max_num_seqs": 2,
           "fair_max_tokens": 4}
    f = fairness("labkit-tiny", cfg, None)
    assert f["capacity_req_s"] > 0
    pushed = 2 ** len(f.get("recalibrations", []))  # a run that did not saturate: 2x again
    assert f["heavy_rate_req_s"] == pytest.approx(2.0 * f["capacity_req_s"] * pushed)
    assert f["verdict"] == "conclusive" or f["verdict"].startswith("inconclusive: ")
    for short in f.get("recalibrations", []):
        assert short["verdict"].startswith("inconclusive: ")
    assert f["light_rate_req_s"] == pytest.approx(f["heavy_rate_req_s"] / 10)
    for policy in ("fcfs", "fair"):
        r = f[policy]
        assert r["failed"] == 0
        assert r["heavy_request_throughput"] > 0
        assert r["saturation"]["slots"] == 2 and r["saturation"]["peak_in_flight"] >= 1
        assert f[f"{policy}_light_p99_ttft_ratio"] == pytest.approx(
            r["light_mixed_p99_ttft_ms"] / r["light_solo_p99_ttft_ms"])
