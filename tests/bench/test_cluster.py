"""``labkit bench cluster`` at toy sizes: every field written, consistent with its own rows."""

import json

import pytest

from labkit.bench import BENCHMARKS, cluster

TINY = {"sizes": (2, 4), "sweep_rate": 20.0, "sweep_s": 2.0, "sweep_scale": 8,
        "day_s": 40.0, "peak_rate": 12.0, "day_scale": 16, "burst_s": 1.0}


@pytest.mark.slow
def test_cluster_bench_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "QUICK", TINY)
    out = tmp_path / "cluster.json"
    assert BENCHMARKS["cluster"] == "labkit.bench.cluster"
    assert cluster.main(["--quick", "--sim-only", "--json", str(out)]) == 0
    p = json.loads(out.read_text())
    for key in ("autoscaler_slo_attainment", "autoscaler_replica_hours", "static_replica_hours",
                "sim_affinity_hit_rate", "sim_round_robin_hit_rate", "sim_affinity_ttft_p50",
                "sim_round_robin_ttft_p50"):
        assert isinstance(p[key], float), key
    # --sim-only: the real-replica fields (tests/router/test_real_replicas.py) are absent, not faked
    assert "affinity_hit_rate" not in p and "failover_lost" not in p
    assert "canary_bad_rolled_back_after" not in p  # tests/bench/test_cluster_canary.py
    day = p["day"]
    n = p["static_replicas"]
    assert p["static_replica_hours"] == pytest.approx(n * TINY["day_s"] / 3600)
    assert p["static_slo_attainment"] >= 0.99
    below = [s for s in day["static"] if s["replicas"] == n - 1]
    assert n == 1 or (below and below[0]["slo_attainment"] < 0.99)  # the smallest that meets
    assert p["replica_hours_saving"] == pytest.approx(
        1 - p["autoscaler_replica_hours"] / p["static_replica_hours"])
    assert p["reactive_replica_hours"] == day["reactive"]["replica_hours"]
    assert day["autoscaler_config"]["lead_s"] == pytest.approx(p["cold_start_s"] + 1.0)
    # both fleets run equally hot at the peak: the target is static's requests/s per replica
    assert day["autoscaler_config"]["target"] == pytest.approx(TINY["peak_rate"] / n)
    assert len(day["rate_curve"][0]) == 3 and len(day["reactive_timeline"]) > 0
    rows = [r for r in p["sweep"] if r["replicas"] == 4]
    assert {r["policy"] for r in rows} == set(cluster.SWEEP_POLICIES)
    assert (tmp_path / "cluster.html").exists()


def _readme_row(label):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [x for x in readme.splitlines() if x.startswith(f"| {label} |")]
    assert len(rows) == 1, label
    return rows[0]


def test_readme_quotes_the_committed_result():
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "datasets" / "results" / "cluster_sim.json"
    p = json.loads(path.read_text())

    def nums(label):
        return [float(x) for x in re.findall(r"\d+\.\d+|\d+", _readme_row(label).split("|")[2])]

    n = p["sim_replicas"]
    assert nums(f"hit rate at {n} replicas: prefix-affinity vs round-robin") == pytest.approx(
        [round(p["sim_affinity_hit_rate"], 3), round(p["sim_round_robin_hit_rate"], 3)])
    assert nums(f"TTFT p50 at {n} replicas (ms): prefix-affinity vs round-robin") == \
        pytest.approx([round(1e3 * p["sim_affinity_ttft_p50"], 1),
                       round(1e3 * p["sim_round_robin_ttft_p50"], 1)])
    assert nums("autoscaler: requests within the TTFT SLO (%)") == pytest.approx(
        [round(100 * p["autoscaler_slo_attainment"], 2), p["ttft_slo_s"]])
    assert nums("replica-hours: autoscaled vs static") == pytest.approx(
        [round(p["autoscaler_replica_hours"], 3), round(p["static_replica_hours"], 3),
         p["static_replicas"], round(abs(100 * p["replica_hours_saving"]), 1)])
    assert ("more" in _readme_row("replica-hours: autoscaled vs static")) == \
        (p["replica_hours_saving"] < 0)
    assert nums("without the forecast (reactive): within the SLO (%), replica-hours") == \
        pytest.approx([round(100 * p["reactive_slo_attainment"], 2),
                       round(p["reactive_replica_hours"], 3)])


def test_readme_quotes_the_committed_real_replica_result():
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "datasets" / "results" / "cluster.json"
    p = json.loads(path.read_text())

    def nums(label):
        return [float(x) for x in re.findall(r"\d+\.\d+|\d+", _readme_row(label).split("|")[2])]

    assert nums("real: hit rate, prefix-affinity vs round-robin") == pytest.approx(
        [round(p["affinity_hit_rate"], 3), round(p["round_robin_hit_rate"], 3),
         round(p["affinity_hit_rate"] / p["round_robin_hit_rate"], 2)])
    assert nums("real: TTFT p50 (ms), prefix-affinity vs round-robin") == pytest.approx(
        [round(1e3 * p["affinity_ttft_p50"]), round(1e3 * p["round_robin_ttft_p50"]),
         round(p["affinity_ttft_p50"] / p["round_robin_ttft_p50"], 2)])
    assert nums("real: a replica SIGKILLed under 6 greedy streams") == pytest.approx(
        [p["failover_requests"], p["failover_lost"]])
    assert ("byte-identical" in _readme_row("real: a replica SIGKILLed under 6 greedy streams")
            ) == p["failover_identical"] is True
    assert p["failover_streams"] == 6 and p["real_replicas"] == 3
    runs = p["canary"]["runs"]
    row = "real: canary rolled back after (candidate requests), healthy one rolled back"
    assert nums(row) == pytest.approx([p["canary_bad_rolled_back_after"], 1,
                                       runs["slow"]["rolled_back_after"], 50,
                                       runs["erroring"]["rolled_back_after"]])
    assert p["canary_bad_rolled_back_after"] == max(runs["slow"]["rolled_back_after"],
                                                    runs["erroring"]["rolled_back_after"])
    assert _readme_row(row).split("|")[2].strip().endswith(
        "yes" if p["canary_good_rolled_back"] else "no")
