"""labkit bench kernels: refuses to time on CPU; its whole flow runs at toy sizes."""

import pytest
import torch

from labkit.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal path")
def test_main_needs_a_gpu(capsys):
    assert bench.main([]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_smoke_run_checks_every_kernel_and_reports():
    payload = bench.run(bench.SMOKE, "cpu")
    assert payload["errors"] == []
    checked = {c["kernel"].split(" ")[0] for c in payload["checks"]}
    assert {"paged_attention_decode", "paged_prefill_attention", "reshape_and_cache",
            "rms_norm", "rotary_embedding", "gptq_matmul", "awq_matmul", "w8a16_matmul",
            "nf4_dequantize"} <= checked
    assert all(c["ok"] for c in payload["checks"]), payload["checks"]
    kernels = {r["kernel"] for r in payload["results"]}
    assert {"paged_attention_decode", "paged_prefill_attention", "gptq_matmul",
            "reshape_and_cache"} <= kernels
    for r in payload["results"]:
        assert r["ms"] > 0
        assert r.get("rel_err_vs_sdpa", 0) < 2e-2 and r.get("rel_err", 0) < 5e-3
    md = bench.to_markdown(payload)
    assert "| kernel | shape | ms |" in md and "paged_attention_decode" in md


def test_targets_are_judged_from_rows():
    b = bench.Bench(bench.SMOKE, "cpu")
    b.copy_gbps = 1000.0
    b.add("paged_attention_decode", "B=64 ctx=4096 Hq=32", 1.0, nbytes=0.85e9)
    b.add("gptq_matmul", "M=1 K=8192 N=8192", 1.0, "fp16", 2.0)
    met = {t["target"].split(" ")[0]: t["met"] for t in bench.targets(b)}
    assert met == {"paged": True, "gptq_matmul": False}
