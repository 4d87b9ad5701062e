"""``labkit bench disagg``'s workload. The setups it runs are tested where they live, at less
cost: the P/D pair's greedy text and pushed KV bytes against the formula in
tests/router/test_pd_cluster.py, the colocated cluster in tests/router/test_real_replicas.py;
the committed run's ``outputs_match`` and ``kv_bytes_match_formula`` in
tests/bench/test_result_provenance.py's checks of datasets/results/."""

from __future__ import annotations

from labkit.bench import disagg


def test_workload_is_seeded_and_mixes_both_kinds():
    a = disagg.workload(disagg.QUICK, seed=3)
    b = disagg.workload(disagg.QUICK, seed=3)
    assert [(r.prompt, r.tag) for r in a] == [(r.prompt, r.tag) for r in b]
    tags = [r.tag for r in a]
    assert tags.count("short") == disagg.QUICK["short"] and tags.count("long") == \
        disagg.QUICK["long"]
