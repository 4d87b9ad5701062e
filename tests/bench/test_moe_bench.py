"""``labkit bench moe --quick --json F``: the keys the issue names, the outputs and bytes checks
true, and the numbers behind them consistent with the tiny checkpoint's shapes (never
timings)."""

import json

import pytest

from labkit.bench import moe
from labkit.model.testing import TINY_MOE

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_quick_run_writes_the_checks(tmp_path):
    out = tmp_path / "moe.json"
    assert moe.main(["--quick", "--json", str(out), "--shipped", str(tmp_path / "none")]) == 0
    d = json.loads(out.read_text())
    assert d["outputs_match"] is True and d["ep_bytes_match_formula"] is True
    assert {"load_average_at_start", "load_average_at_end"} <= set(d["environment"])
    assert out.with_suffix(".html").is_file()
    (r,) = d["results"]  # no shipped folder given: the tiny checkpoint only
    assert all(r["outputs_equal_reference"].values())
    assert set(r["outputs_equal_reference"]) == {"loop", "fused", "ep1", "ep2"}
    # the bytes by hand: tiny Qwen3-MoE, 2 MoE layers, top-2, hidden 64, float32
    k = TINY_MOE["qwen3_moe"][1]["num_experts_per_tok"]
    ep1, ep2 = r["ep"]
    for e in (ep1, ep2):
        assert e["dispatch_bytes_per_step"] == e["combine_bytes_per_step"] == \
            pytest.approx(e["tokens_per_step"] * 2 * k * 64 * 4)
    assert ep1["remote_bytes_per_step"] == 0 < ep2["remote_bytes_per_step"]
    # the dense twin's parameters are the MoE's active ones, to one MLP channel per layer
    t = r["throughput"]
    assert abs(t["dense_params"] - t["moe_active_params"]) <= 3 * 64 * 2 / 2
    assert t["moe_total_params"] > t["moe_active_params"]
