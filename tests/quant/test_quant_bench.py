"""`labkit bench quant --quick` end to end on the shipped model: schema and the invariants that
do not depend on how well the model was trained."""

import json

import pytest

from labkit.bench import quant as bench


def test_bench_quant_quick(tmp_path):
    pytest.importorskip("labkit.train.corpus")
    out = tmp_path / "quant.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    rows = {r["format"]: r for r in d["results"]}
    assert set(rows) == {"fp32", "bf16", "int8", "int4_rtn", "gptq", "awq", "nf4", "fp8",
                         "int8_kv"}
    for r in d["results"]:
        assert {"format", "bits", "group_size", "perplexity", "kl", "weight_bytes"} <= set(r)
        assert r["weight_bytes"] == r["calculator_bytes"]
    assert rows["fp32"]["kl"] == 0
    assert 0 < rows["int8"]["kl"] < rows["fp8"]["kl"] < rows["int4_rtn"]["kl"]
    assert rows["int8"]["perplexity"] <= 1.01 * rows["fp32"]["perplexity"]
    assert rows["int4_rtn"]["weight_bytes"] < 0.35 * rows["fp32"]["weight_bytes"]
    assert d["targets"]["bytes_within_5pct_of_calculator"]
    assert d["settings"]["group_size_64_fallback_layers"] == ["mlp.down_proj"]
