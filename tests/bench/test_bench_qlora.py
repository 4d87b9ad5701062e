"""``labkit bench qlora`` at toy sizes: the payload's keys, and the checks that make its table
mean something: (a) as trained equals (d) served unmerged over NF4 through the engine, and the
fp merge into the de-quantized NF4 base equals (a)."""

from __future__ import annotations

import json
import math

import pytest

from labkit.model.loader import available_models


@pytest.mark.slow
@pytest.mark.skipif("labkit-tiny" not in available_models(), reason="labkit-tiny not shipped")
def test_bench_qlora_quick_payload(tmp_path, monkeypatch):
    import labkit.bench.qlora as q

    monkeypatch.setattr(q, "QUICK", {"steps": 3, "max_chars": 30_000, "heldout_chars": 8_000,
                                     "eval_windows": 2, "calib_windows": 4})
    out = tmp_path / "qlora.json"
    assert q.main(["--quick", "--json", str(out)]) == 0
    p = json.loads(out.read_text())
    assert set(q.SYSTEMS) == set(p["perplexity"]) == set(p["weight_bytes"])
    assert all(math.isfinite(v) and v > 1 for v in p["perplexity"].values())
    assert p["a_vs_d_nf4_rel_diff"] < 1e-3
    ppl = p["perplexity"]
    assert abs(ppl["c_fp_merged"] - ppl["a_nf4_adapter"]) / ppl["a_nf4_adapter"] < 1e-4
    b = p["weight_bytes"]
    assert b["nf4_base"] < b["fp_base"] and b["c_gptq_merged"] < b["fp_base"]
    assert b["d_nf4_unmerged"] > b["nf4_base"]  # the adapter's bytes on top
    # the negative control: merged and re-quantized to NF4 is not the trained model
    assert abs(ppl["b_nf4_naive_merge"] - ppl["a_nf4_adapter"]) / ppl["a_nf4_adapter"] > 1e-3
    assert 0 <= p["naive_merge_nf4_bytes_changed"] < 1
    assert "load_average_at_start" in p["environment"] and "run_s" not in p["environment"]
