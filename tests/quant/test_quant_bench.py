"""`labkit bench quant --quick` end to end on the shipped model: schema and the invariants that
do not depend on how well the model was trained."""

import json

import pytest
import torch

from labkit.bench import quant as bench


@pytest.mark.slow
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


def test_bench_quant_engine_int8_kv_section():
    """The paged engine with kv_cache_dtype='int8' under the same byte budget as fp32 KV:
    labkit-tiny (6 layers, 2 kv heads, head_dim 32, fp32) has 2*6*16*2*32*4 = 49152 bytes per
    fp32 block and 2*6*16*2*(32+2) = 13056 per INT8 block, so 8 fp32 blocks' bytes = 30 INT8
    blocks; the INT8 engine's greedy tokens equal the contiguous INT8 reference's."""
    pytest.importorskip("labkit.train.corpus")
    from labkit.bench.kv_int8_engine import run_engine_int8_kv
    from labkit.model.loader import load_pretrained

    model, _ = load_pretrained("labkit-tiny")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 4000, (24,), generator=g).tolist() for _ in range(4)]
    e = run_engine_int8_kv(model, prompts, 12, auto_blocks=8)
    auto, int8 = e["rows"]
    assert e["kv_cache_bytes"] == 8 * 49152
    assert (auto["kv_bytes_per_block"], auto["num_blocks"]) == (49152, 8)
    assert (int8["kv_bytes_per_block"], int8["num_blocks"]) == (13056, 30)
    assert int8["matches_int8_reference"] == 4
    # 4 sequences of 36 tokens need 12 blocks: the 8 fp32 blocks force preemptions, 30 do not
    assert auto["num_preemptions"] > 0 and int8["num_preemptions"] == 0
