"""The README's serving numbers are the ones in datasets/results/serve.json (the project rule
tests/notebooks/test_readme_numbers.py applies to the other benchmarks)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
R = json.loads((ROOT / "datasets" / "results" / "serve.json").read_text())


def _numbers(label: str) -> list[float]:
    rows = [ln for ln in README.splitlines() if ln.startswith(f"| {label}")]
    assert len(rows) == 1, f"want one README row starting '| {label}', got {len(rows)}"
    result = rows[0].strip("|").split("|")[1]
    return [float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*\.?\d*", result)]


def test_serve_rows_match_serve_json():
    n = _numbers("HTTP throughput at concurrency 16")
    assert n[:3] == pytest.approx([R["output_throughput"], R["in_process_output_throughput"],
                                   R["http_over_in_process"]], abs=0.06)
    assert n[4:6] == [R["greedy_text_matches"], R["completed"]]
    n = _numbers("streaming TTFT p50 at concurrency 1")
    assert n == pytest.approx([R["concurrency_1"]["median_ttft_ms"],
                               R["in_process_median_ttft_ms"], R["c1_ttft_overhead_ms"]],
                              abs=0.6)
    n = _numbers("noisy neighbour")
    f = R["fairness"]
    assert n == pytest.approx([f["fcfs_light_p99_ttft_ratio"], f["fair_light_p99_ttft_ratio"]],
                              abs=0.6)
    n = _numbers("rate sweep")  # n[3] is the 99 of "p99"
    sweep = R["sweep"]
    assert n[:3] == pytest.approx([r["request_throughput"] for r in sweep], abs=0.06)
    assert n[4:7] == pytest.approx([r["p99_ttft_ms"] / 1000 for r in sweep], abs=0.06)
