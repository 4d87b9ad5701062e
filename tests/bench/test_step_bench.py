"""``labkit bench step --quick --json F``: every variant at every batch, the profiler's phases,
greedy tokens equal to eager's, positive ratios, the compile record, llama.cpp or its note, and
the start-up pair and its stages, and the four headline keys (the shape of the result: no
timing is asserted). :func:`step.headline` and the stages are also checked on hand-made
numbers, without running anything."""

from __future__ import annotations

import json

import pytest

from labkit.bench import BENCHMARKS, step, step_gemv
from labkit.engine.profiler import PHASES


@pytest.mark.slow  # three inductor compiles and five fresh interpreters: a few minutes
def test_quick_run_writes_every_variant_side_by_side(tmp_path, tiny_ckpt):
    assert BENCHMARKS["step"] == "labkit.bench.step"
    out = tmp_path / "step.json"
    assert step.main(["--quick", "--json", str(out), "--model", str(tiny_ckpt)]) == 0
    d = json.loads(out.read_text())
    assert {"config", "loadavg_at_start", "rows", "ratios", "outputs_match", "compile",
            "llama_cpp", "gemv", "startup", "environment"} <= set(d)
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
    # llama.cpp's rounds interleaved with labkit's batch-1 rounds: one after each
    assert "note" in ll or len(ll["decode_tok_s_rounds"]) == 2 * step.QUICK["rounds"]
    g = d["gemv"]
    assert g["bytes"] > 0 and g["linear_gb_s"] > 0 and g["dot_gb_s"] > 0
    assert g["max_abs_diff"] < 1e-3  # the compiled dot products are the same products
    s = d["startup"]
    assert s["import_torch_s"] > 0 and s["first_token_s"] > 0
    assert s["first_token_over_import"] == pytest.approx(s["first_token_s"] / s["import_torch_s"])
    assert list(s["stages_s"]) == list(step.STAGES) and s["after_import_torch_s"] > 0
    assert all(isinstance(v, float) and v > -0.01 for v in s["stages_s"].values())
    # the headline: every cure on over llama.cpp at batch 1, over eager at the largest batch
    assert isinstance(d["outputs_match"], bool)
    assert d["batch32_vs_eager_batch"] == max(batches) and d["batch32_vs_eager"] > 0
    assert d["batch32_best_vs_eager"] >= d["batch32_vs_eager"] and d["handoff_us"] > 0
    assert (d["batch1_vs_llamacpp"] is None) == ("note" in ll)
    assert d["batch1_vs_llamacpp"] is None or d["batch1_vs_llamacpp"] > 0
    assert d["startup_over_torch_import_s"] == \
        pytest.approx(s["first_token_s"] - s["import_torch_s"])
    pytest.importorskip("plotly")
    assert out.with_suffix(".html").is_file()


def _rows(tok_s: dict) -> list[dict]:
    return [{"variant": v, "batch": b, "decode_tok_s": x} for (v, b), x in tok_s.items()]


def test_headline_picks_batch_32_or_says_which_batch_it_used():
    start = {"first_token_s": 1.75, "import_torch_s": 1.5}
    rows = _rows({("eager", 1): 10.0, ("all", 1): 30.0, ("fused+compiled", 1): 36.0,
                  ("eager", 4): 20.0, ("all", 4): 50.0})
    h = step.headline(rows, {"decode_tok_s": 40.0}, start)
    assert h == {"batch1_vs_llamacpp": 0.75, "batch1_best_variant": "fused+compiled",
                 "batch1_best_vs_llamacpp": 0.9, "batch32_vs_eager": 2.5,
                 "batch32_best_variant": "all", "batch32_best_vs_eager": 2.5,
                 "batch32_vs_eager_batch": 4, "startup_over_torch_import_s": 0.25}
    rows += _rows({("eager", 32): 100.0, ("all", 32): 300.0, ("fused+compiled", 32): 330.0})
    h = step.headline(rows, {"note": "llama.cpp: not installed"}, start)
    assert (h["batch32_vs_eager"], h["batch32_vs_eager_batch"]) == (3.0, 32)
    assert (h["batch32_best_variant"], h["batch32_best_vs_eager"]) == ("fused+compiled", 3.3)
    assert h["batch1_vs_llamacpp"] is None  # no llama.cpp: no ratio, the note says why
    no_batch1 = [r for r in rows if r["batch"] != 1]
    assert step.headline(no_batch1, {"decode_tok_s": 40.0}, start)["batch1_vs_llamacpp"] is None


def test_stages_add_up_to_the_first_token():
    # marks (seconds after the spawn) and the model load's duration, as a child reports them
    marks = [0.02, 1.40, 1.41, 1.46, 1.60, 1.62, 0.05]
    st = step._stages(marks)
    assert list(st) == list(step.STAGES)
    assert st["import torch"] == pytest.approx(1.38) and st["model load"] == 0.05
    assert st["engine build"] == pytest.approx(1.60 - 1.46 - 0.05)
    assert sum(st.values()) == pytest.approx(1.62)


def test_weight_streaming_reads_every_linear_weight_once_per_pass():
    """``gemv``: the bytes are the model's linear weights (a tied LM head counted as read),
    both ways give the same products; the speeds are reported, never asserted."""
    from labkit.engine.piecewise import cxx_compiler
    from labkit.model import testing

    if cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build the dot-product graphs here")
    model = testing.tiny_model(seed=1)
    c = model.config
    per_layer = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * \
        c.head_dim + c.num_attention_heads * c.head_dim * c.hidden_size + \
        3 * c.hidden_size * c.intermediate_size
    want = 4 * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)
    g = step_gemv.weight_streaming(model, rounds=1, passes=1)
    assert g["bytes"] == want and g["weights"] == 7 * c.num_hidden_layers + 1
    assert g["max_abs_diff"] < 1e-5 and g["linear_gb_s"] > 0 and g["dot_gb_s"] > 0
    assert g["dot_over_linear"] == pytest.approx(g["dot_gb_s"] / g["linear_gb_s"])
