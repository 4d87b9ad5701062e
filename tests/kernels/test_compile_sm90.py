"""The kernels' GPU variants compile for Hopper with the real Triton compiler (no GPU needed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# variants each part compiles at least (attention 12, quant 13, small 5, moe_lora 12 today)
MIN_VARIANTS = {"attention": 10, "quant": 8, "small": 5, "moe_lora": 12}


@pytest.mark.parametrize("group", list(MIN_VARIANTS))
def test_kernels_compile_for_sm90(group):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run([sys.executable, str(script), group], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) >= MIN_VARIANTS[group] and not any(ln.startswith("FAIL") for ln in lines)


def test_every_variant_belongs_to_a_compiled_group():
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import compile_sm90 as c
    finally:
        sys.path.pop(0)
    groups = [c._group(fn) for fn, *_ in c.variants()]
    assert set(groups) == set(c.GROUPS) == set(MIN_VARIANTS)
    assert len(groups) >= sum(MIN_VARIANTS.values())


def test_kernels_static_report(tmp_path):
    """`labkit bench kernels-static`: the decode GEMVs compile for sm_90 without spilling, and
    the GPTQ GEMV keeps its register budget (the occupancy its docstring argues for)."""
    pytest.importorskip("triton.backends.nvidia")
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "static.json"
    proc = subprocess.run([sys.executable, "-m", "labkit.cli", "bench", "kernels-static",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["kernel"].split(" GEMV")[0]: r for r in json.loads(out.read_text())["results"]}
    assert {"gptq", "gptq act-order", "awq", "w8a16"} <= set(rows)
    for name in ("gptq", "awq", "w8a16"):
        assert rows[name]["local"] == 0 and rows[name]["loop_sass"] > 0, rows[name]
    assert rows["gptq"]["registers"] <= 96 and rows["gptq"]["loop_barriers"] == 0
    assert 3 <= rows["gptq"]["sass_per_weight"] < 8  # >= 3: and-or, subtract, FMA per weight


def test_kernels_static_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "labkit.cli", "bench", "kernels-static"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_issue_budget_per_weight_by_hand():
    """132 SMs x 128 threads issued per clock x 1.98 GHz over 4.8 TB/s of 4-bit weights (two per
    byte): 33.45e12 / 9.6e12 = 3.4848 instructions per thread per weight; 8-bit doubles it."""
    from labkit.bench.kernels_static import issue_budget_per_weight

    assert issue_budget_per_weight() == pytest.approx(132 * 128 * 1.98e9 / 9.6e12)
    assert issue_budget_per_weight() == pytest.approx(3.4848)
    assert issue_budget_per_weight(8) == pytest.approx(2 * issue_budget_per_weight(4))
