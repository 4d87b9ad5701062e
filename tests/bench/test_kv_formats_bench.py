"""kv-formats bench at toy sizes: the layouts' bytes per token against hand counts, every
engine's greedy tokens against its reference, and the written JSON / chart (never timings)."""

import json

import pytest

from labkit.bench import BENCHMARKS, kv_formats
from labkit.sim.kv_capacity import capacity_table

SIZES = {"num_requests": 3, "prompt_len": 20, "max_tokens": 4, "pool_seqs_fp32": 2,
         "ppl": (2, 32), "mla": {**kv_formats.QUICK["mla"], "context": 32, "rounds": 1}}


@pytest.mark.slow
def test_quick_toy_sizes(tmp_path, monkeypatch):
    assert BENCHMARKS["kv-formats"] == "labkit.bench.kv_formats"
    monkeypatch.setattr(kv_formats, "QUICK", {**kv_formats.QUICK, **SIZES})
    out_json = tmp_path / "kv.json"
    assert kv_formats.main(["--quick", "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    by = {r["layout"]: r for r in out["rows"]}
    assert out["outputs_match"] and all(r["outputs_match"] for r in out["rows"])
    # tiny Llama, 2 layers x (K, V) x KV heads x 16 x 4 bytes (fp32)
    assert [by[k]["kv_bytes_per_token"] for k in ("mha", "gqa", "mqa", "sliding")] == \
        [2 * 2 * 4 * 16 * 4, 2 * 2 * 2 * 16 * 4, 2 * 2 * 1 * 16 * 4, 2 * 2 * 2 * 16 * 4]
    # tiny DeepSeek: 2 layers x (kv_lora_rank 16 + rope 8) x 4 bytes; MHA: 2 x 4 heads x 16
    assert by["mla"]["kv_bytes_per_token"] == 2 * 24 * 4
    assert out["mla_vs_mha_bytes"] == pytest.approx(24 / (2 * 4 * 16))
    assert out["mla_vs_mha_bytes_deepseek_v3"] == pytest.approx(576 / 32768)
    # labkit-tiny: 6 layers, 2 KV heads of 32; fp32 4 bytes, int8 1 byte + a 2-byte scale
    assert by["labkit-tiny-auto"]["kv_bytes_per_token"] == 2 * 6 * 2 * 32 * 4
    assert by["labkit-tiny-int8"]["kv_bytes_per_token"] == 2 * 6 * 2 * (32 + 2)
    assert by["sliding"]["window_freed_blocks"] > 0 and by["gqa"]["window_freed_blocks"] == 0
    assert by["sliding"]["sequences_fit"] > by["gqa"]["sequences_fit"]
    ppl = {r["kv"]: r for r in out["quant_kv_perplexity"]}
    assert ppl["fp32"]["kl"] == 0 and ppl["int8"]["kl"] > 0
    m = out["mla_decode"]
    assert m["max_abs_diff"] < 1e-3 and m["absorbed_ms"] > 0 and m["expanded_ms"] > 0
    assert out["capacity_h200_32k"] == json.loads(json.dumps(capacity_table()))
    assert "load_average_at_start" in out["environment"]
    assert (tmp_path / "kv.html").exists()
