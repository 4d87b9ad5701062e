"""``labkit bench cluster``'s canary fields, measured by the benchmark's own function over fake
replicas (fixed 20 ms prefill) instead of labkit-tiny processes, so it runs in seconds: a slow
and an erroring candidate are rolled back, the healthy one is kept."""

import pytest
from fake_openai import fake_replica

from labkit.bench import cluster
from labkit.router.faults import serve_in_thread

SMALL = {"bad_requests": 200, "good_requests": 100, "delay_s": 1.0, "error_rate": 0.5,
         "concurrency": 8, "weight": 0.5}


def canary_on_fakes(quick=True, seed=0):
    """Stands in for ``cluster.run_canary_real`` (which starts two labkit-tiny processes)."""
    with serve_in_thread(fake_replica("a", 0.02)) as a, \
            serve_in_thread(fake_replica("b", 0.02)) as b:
        return cluster.canary_fields([a], b, quick, seed)


@pytest.mark.slow
def test_canary_fields(monkeypatch):
    monkeypatch.setattr(cluster, "CANARY_QUICK", SMALL)
    p = canary_on_fakes()
    runs = p["canary"]["runs"]
    assert p["canary_good_rolled_back"] is False and not runs["healthy"]["rolled_back"]
    assert runs["slow"]["rolled_back"] and runs["erroring"]["rolled_back"]
    assert p["canary_bad_rolled_back_after"] == max(runs["slow"]["rolled_back_after"],
                                                    runs["erroring"]["rolled_back_after"])
    assert p["canary_bad_rolled_back_after"] <= 80  # see tests/router/test_canary_router.py
    assert "TTFT p99" in runs["slow"]["reason"] and "error rate" in runs["erroring"]["reason"]
    assert sum(runs["healthy"]["seen"].values()) == SMALL["good_requests"]
