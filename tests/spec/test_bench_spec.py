"""The spec benchmark's plumbing (schema, output check, roofline arithmetic); no timing asserted."""

from __future__ import annotations

import pytest

from labkit.bench.spec import SIM, run, sim_rows
from labkit.sim.cost import step_time
from labkit.spec.theory import expected_tokens_per_step

KEYS = {"proposer", "gamma", "tokens_per_s", "baseline_tokens_per_s", "speedup",
        "acceptance_rate", "predicted_speedup", "outputs_match"}


def test_sim_rows_hand_computed():
    row = sim_rows({3: 0.5})[0]
    dec = step_time(SIM["target"], SIM["gpu"], 0, 1, SIM["context"])
    draft = step_time(SIM["draft"], SIM["gpu"], 0, 1, SIM["context"])
    c = draft / dec
    # a 7B verify of 4 tokens is memory-bound: it costs a decode step (within 1%)
    assert row["verify_over_decode"] == pytest.approx(1.0, abs=0.01)
    assert 0.1 < c < 0.35  # a 1.1B draft reads ~1/6 of the bytes, plus the fixed step overhead
    e = expected_tokens_per_step(0.5, 3)
    assert row["speedup"] == pytest.approx(e / (3 * c + row["verify_over_decode"]))
    assert row["predicted_speedup"] == pytest.approx(e / (3 * c + 1))
    assert KEYS <= set(row) and row["outputs_match"] is None


def test_run_tiny_schema_and_outputs_match():
    payload = run(quick=True, sizes={"num_prompts": 1, "max_tokens": 12, "gammas": [2],
                                     "rounds": 1})
    measured = [r for r in payload["results"] if r["measured"]]
    assert {r["proposer"] for r in measured} == {"ngram", "draft_model"}
    for r in payload["results"]:
        assert KEYS <= set(r)
    assert all(r["outputs_match"] is True for r in measured)
    assert all(0.0 <= r["acceptance_rate"] <= 1.0 for r in measured)
    # draft shapes: every shape is priced with the same α and engine costs, so the modelled
    # speed-up falls as the shape's draft cost c rises (times themselves are not asserted:
    # a 12-token run on a shared CPU orders them by luck)
    shapes = payload["draft_shapes"]
    assert {(s["layers"], s["hidden"]) for s in shapes} >= {(1, 128), (2, 128)}
    by_c = sorted(shapes, key=lambda s: s["draft_cost_c"])
    speedups = [s["speedup_at_measured_alpha"][2] for s in by_c]
    assert all(x > 0 for x in speedups)
    assert all(a > b for a, b in zip(speedups, speedups[1:]))  # strictly: c is priced
    # the report and the chart read the same payload (labkit/bench/spec_report.py)
    import tempfile
    from pathlib import Path

    from labkit.bench.spec_report import print_report, write_chart

    print_report(payload, SIM)
    with tempfile.TemporaryDirectory() as d:
        write_chart(payload, Path(d) / "spec.html", SIM)
        assert (Path(d) / "spec.html").stat().st_size > 0
