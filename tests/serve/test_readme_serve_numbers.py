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
    n = _numbers("rate sweep")  # n[k] is the 99 of "p99"
    sweep = R["sweep"]
    k = len(sweep)
    assert n[:k] == pytest.approx([r["request_throughput"] for r in sweep], abs=0.06)
    assert n[k + 1:2 * k + 1] == pytest.approx([r["p99_ttft_ms"] / 1000 for r in sweep],
                                               abs=0.06)


def _cells(label: str) -> list[list[float]]:
    """The numbers of each value cell of the README row starting with ``label``."""
    rows = [ln for ln in README.splitlines() if ln.startswith(f"| {label}")]
    assert len(rows) == 1, f"want one README row starting '| {label}', got {len(rows)}"
    return [[float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*\.?\d*", c)]
            for c in rows[0].strip().strip("|").split("|")[1:]]


def test_llamacpp_side_by_side_rows_match_json():
    L = json.loads((ROOT / "datasets" / "results" / "serve_llamacpp.json").read_text())
    rows = {(r["backend"], r["concurrency"]): r for r in L["rows"]}
    ratio = L["labkit_over_llamacpp"]
    for conc, n_req, keys in ((1, 8, ("output_throughput", "median_ttft_ms", "median_tpot_ms")),
                              (8, 32, ("output_throughput", "median_ttft_ms"))):
        lk, ll, rat = _cells(f"concurrency {conc} ({n_req} requests)")
        assert rows[("labkit", conc)]["completed"] == rows[("llama.cpp", conc)]["completed"] \
            == n_req
        assert lk == pytest.approx([rows[("labkit", conc)][k] for k in keys], rel=0.01)
        assert ll == pytest.approx([rows[("llama.cpp", conc)][k] for k in keys], rel=0.01)
        assert rat == pytest.approx([ratio[str(conc)][k.removesuffix("_ms")] for k in keys],
                                    abs=0.006)
    assert L["greedy_same_text"] == L["greedy_checked"] == 6
    assert all(L["stopped"].values())


def test_knee_row_matches_serve_json():
    k = R["knee"]
    n = _numbers("knee beside the simulator")
    f = k["step_fit"]
    assert n == pytest.approx([k["measured_capacity_req_s"], k["simulated_capacity_req_s"],
                               k["measured_over_simulated"], f["a_s"] * 1e3,
                               f["per_token_s"] * 1e3, f["per_seq_s"] * 1e3, f["r2"]],
                              abs=0.06)


def test_soak_numbers_match_serve_soak_json():
    S = json.loads((ROOT / "datasets" / "results" / "serve_soak.json").read_text())
    t = S["memory_trend"]
    want = (f"{S['disconnects']} disconnects, {S['invalid_4xx']} invalid requests, "
            f"{S['num_5xx']} 5xx, {S['greedy_compared']} greedy")
    text = " ".join(README.replace("\u2212", "-").split())  # the README writes minus as U+2212
    assert want in text
    assert f"accepted {S['accepted']:.0f} = finished" in text
    assert f"{t['requests_held']['growth_per_1000_requests']:.2f}/1,000" in text
    assert f"+{t['rss_kb']['growth_per_1000_requests'] / 1024:.1f} MiB/1,000" in text
    assert S["memory_flat"] and S["num_5xx"] == 0 and S["requests_held_at_end"] == 0


def test_engine_modes_row_matches_serve_json():
    """Every engine mode x torch-thread variant of the run, and the baseline's thread counts."""
    n = _numbers("engine in its own process (the default) or a thread")
    want = []
    for mode in ("process", "thread"):
        for t, r in sorted(R["engine_modes"][mode].items()):
            want += [float(t), r["http_over_in_process"], r["c1_ttft_overhead_ms"]]
    for t, r in sorted(R["in_process_by_threads"].items()):
        want += [float(t), r["output_throughput"], r["median_ttft_ms"]]
    assert n == pytest.approx(want, abs=0.06)
    assert R["engine_mode"] == "process"  # the headline is labkit serve's default mode
