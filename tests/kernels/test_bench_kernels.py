"""labkit bench kernels: refuses to time on CPU; its whole flow runs at toy sizes."""

import pytest
import torch

from labkit.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal path")
def test_main_needs_a_gpu(capsys):
    assert bench.main([]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_checks_every_kernel_and_reports():
    payload = bench.run(bench.SMOKE, "cpu")
    assert payload["errors"] == []
    checked = {c["kernel"].split(" ")[0] for c in payload["checks"]}
    assert {"paged_attention_decode", "paged_prefill_attention", "reshape_and_cache",
            "rms_norm", "rotary_embedding", "gptq_matmul", "awq_matmul", "w8a16_matmul",
            "nf4_dequantize", "fused_moe", "bgmv", "sgmv"} <= checked
    assert all(c["ok"] for c in payload["checks"]), payload["checks"]
    shapes = " ".join(c["shape"] for c in payload["checks"])
    for odd in ("Hq=14 Hkv=2", "D=80", "D=96", "N=200", "5x4864"):  # the odd-shape section ran
        assert odd in shapes
    kernels = {r["kernel"] for r in payload["results"]}
    assert {"paged_attention_decode", "paged_prefill_attention", "gptq_matmul",
            "reshape_and_cache", "paged_attention_decode (int8 KV)"} <= kernels
    int8 = next(r for r in payload["results"] if r["kernel"].endswith("(int8 KV)"))
    assert int8["rel_err_vs_bf16_cache"] < 2e-2  # int8 rounding of the cache, no more
    for r in payload["results"]:
        assert r["ms"] > 0
        assert r.get("rel_err_vs_sdpa", 0) < 2e-2 and r.get("rel_err", 0) < 5e-3
    md = bench.to_markdown(payload)
    assert "| kernel | shape | ms |" in md and "paged_attention_decode" in md


def test_targets_are_judged_from_rows():
    b = bench.Bench(bench.SMOKE, "cpu")
    b.copy_gbps = 1000.0
    b.add("paged_attention_decode", "B=64 ctx=4096 Hq=32", {"ms": 1.0}, nbytes=0.85e9)
    b.add("gptq_matmul", "M=1 K=8192 N=8192", {"ms": 1.0}, "fp16", {"ms": 2.0})
    met = {t["target"].split(" ")[0]: t["met"] for t in bench.targets(b)}
    assert met == {"paged": True, "gptq_matmul": False, "awq_matmul": False}
    awq = next(t for t in bench.targets(b) if t["target"].startswith("awq"))
    assert awq["value"] is None and awq["measured"] is False  # no row: listed, not dropped


def test_rotated_inputs_copy_only_large_tensors():
    from labkit.kernels.timing import rotated_inputs

    big, small = torch.zeros(1 << 20), torch.zeros(8)  # 4 MiB and 32 bytes
    sets = rotated_inputs((big, small, 3), rotate_bytes=16 << 20)
    assert len(sets) == 4  # 16 MiB of rotation / 4 MiB per call
    assert sets[0][0] is big and all(s[1] is small and s[2] == 3 for s in sets)
    assert len({s[0].data_ptr() for s in sets}) == 4  # distinct copies of the big one
    assert len(rotated_inputs((small,), rotate_bytes=16 << 20)) == 1  # nothing worth rotating
