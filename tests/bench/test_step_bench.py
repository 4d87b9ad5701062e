"""``labkit bench step --quick --json F``: every variant at every batch, the profiler's phases,
greedy tokens equal to eager's, positive ratios, the compile record, llama.cpp or its note, and
the start-up pair (the shape of the result: no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from labkit.bench import BENCHMARKS, step
from labkit.engine.profiler import PHASES

pytestmark = pytest.mark.slow  # three inductor compiles and two fresh interpreters: ~90 s


def test_quick_run_writes_every_variant_side_by_side(tmp_path, tiny_ckpt):
    assert BENCHMARKS["step"] == "labkit.bench.step"
    out = tmp_path / "step.json"
    assert step.main(["--quick", "--json", str(out), "--model", str(tiny_ckpt)]) == 0
    d = json.loads(out.read_text())
    assert {"config", "loadavg_at_start", "rows", "ratios", "outputs_match", "compile",
            "llama_cpp", "startup", "environment"} <= set(d)
    assert len(d["loadavg_at_start"]) == 3 and "load_average_at_start" in d["environment"]
    assert d["outputs_match"] is True and d["mismatches"] == []
    # the overlap variants (async scheduling) are measured and checked against eager too
    assert {"overlap", "all"} <= set(d["config"]["variants"]) == set(step.VARIANTS)
    batches = step.QUICK["batches"]
    assert sorted((r["variant"], r["batch"]) for r in d["rows"]) == \
        sorted((v, b) for v in step.VARIANTS for b in batches)
    for r in d["rows"]:
        assert set(r["phases_ms"]) == set(PHASES) and r["decode_tok_s"] > 0
        assert r["rounds"] == step.QUICK["rounds"]
        # tokens/s is the batch over the mean decode step
        assert r["decode_tok_s"] == pytest.approx(1e3 * r["batch"] / r["step_ms"])
    assert set(d["ratios"]) == {f"batch {b}" for b in batches}
    for rs in d["ratios"].values():
        assert set(rs) == set(step.VARIANTS) - {"eager"} and all(x > 0 for x in rs.values())
    for name in ("compiled", "fused+compiled", "all"):
        c = d["compile"][name]
        # compiled here, or (a machine without a C++ compiler) a named reason
        assert (c["compiled"] and list(c["compile_s"]) == [str(b) for b in batches]) or \
            (not c["compiled"] and c["reason"])
    ll = d["llama_cpp"]
    assert ll == {"note": "llama.cpp: not installed"} or ll["decode_tok_s"] > 0
    s = d["startup"]
    assert s["import_torch_s"] > 0 and s["first_token_s"] > 0
    assert s["first_token_over_import"] == pytest.approx(s["first_token_s"] / s["import_torch_s"])
    pytest.importorskip("plotly")
    assert out.with_suffix(".html").is_file()
