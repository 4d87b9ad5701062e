"""The numbers the README quotes are the ones in the committed benchmark JSON.

Project rule: every headline number a learner reads is reproduced by a `labkit bench` command and
matches its committed result in datasets/results/. Rerunning a bench without updating the README
(or editing the README by hand) fails here, naming the row. The notebooks read the same files, so
a renamed or deleted result would silently skip their comparison cells: that fails here too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "datasets" / "results"


def _result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _row(label: str) -> list[str]:
    """Cells of the README table row whose first cell is `label` (exactly one such row)."""
    rows = [line for line in README.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, f"README: want one table row starting '| {label} |', got {len(rows)}"
    return [c.strip().strip("*") for c in rows[0].strip("|").split("|")][1:]


def _num(cell: str) -> float:
    m = re.search(r"-?[\d,]*\.?\d+", cell)
    assert m, f"no number in {cell!r}"
    return float(m.group().replace(",", ""))


QUANT_ROWS = {"fp32": "fp32", "bf16": "bf16", "int8 (W8A16)": "int8", "int4_rtn g128": "int4_rtn",
              "gptq g128 act-order": "gptq", "awq g128": "awq", "nf4 (block 64)": "nf4",
              "fp8 e4m3": "fp8"}


@pytest.mark.parametrize("label", QUANT_ROWS)
def test_quant_table_matches_quant_json(label):
    r = {x["format"]: x for x in _result("quant")["results"]}[QUANT_ROWS[label]]
    ppl, kl, weight_bytes, tok_s = _row(label)
    assert _num(ppl) == pytest.approx(r["perplexity"], abs=6e-4), f"{label}: perplexity"
    assert _num(kl) == pytest.approx(r["kl"], rel=0.02, abs=6e-6), f"{label}: KL"
    assert _num(weight_bytes) == r["weight_bytes"], f"{label}: weight bytes"
    assert _num(tok_s) == round(r["tokens_per_s"]), f"{label}: CPU decode tok/s"


def test_spec_table_matches_spec_json():
    results = _result("spec")["results"]
    by = {(r["proposer"].split(":")[0], r["gamma"]): r for r in results}
    gammas = [1, 2, 4, 6, 8]
    checks = {"ngram: speed-up": ("ngram", "speedup"),
              "ngram: accepted / proposed": ("ngram", "acceptance_rate"),
              "draft_model: speed-up": ("draft_model", "speedup"),
              "draft_model: accepted / proposed": ("draft_model", "acceptance_rate"),
              "roofline estimate, TinyLlama-1.1B → Llama-2-7B on A100, at the tiny pair's α":
                  ("sim", "speedup")}
    if any(p == "eagle" for p, _ in by):  # the shipped EAGLE head's rows
        checks |= {"eagle: speed-up": ("eagle", "speedup"),
                   "eagle: accepted / proposed": ("eagle", "acceptance_rate")}
    for label, (proposer, key) in checks.items():
        for g, cell in zip(gammas, _row(label)):
            assert _num(cell) == round(by[(proposer, g)][key], 2), f"{label}, γ={g}"
    baseline = round(results[0]["baseline_tokens_per_s"])
    assert f"{baseline} tok/s" in README, f"README: the plain engine should read {baseline} tok/s"


def test_serving_claims_match_their_json():
    mem, bat, pre = _result("memory"), _result("batching"), _result("prefix")
    paged, contiguous = _row('"paged KV wastes < 4%" — Llama-2-7B on A100-80GB, chat workload '
                             "(simulated)")[0].split(";")[0].split(",")
    assert _num(paged) == round(mem["paged_utilization"], 3)
    assert _num(contiguous) == round(mem["contiguous_utilization"], 3)
    real = _row("same, real labkit-tiny")[0]
    assert [_num(x) for x in real.split(",")] == [round(r["utilization"], 3)
                                                  for r in mem["real"]["rows"]]
    cell = _row('"continuous batching 2–10×" — 128 requests, batch 16, '
                'chat-shaped `max_tokens`, CPU')[0]
    numbers = re.findall(r"\d[\d,]*\.?\d*(?=×| tok/s|,|:)", cell)
    quoted = [float(x.replace(",", "")) for x in numbers]
    want = [round(bat["continuous_tokens_per_s"]), round(bat["static_tokens_per_s"]),
            round(bat["hf_tokens_per_s"]), round(bat["continuous_over_static"], 2),
            round(bat["continuous_over_hf"], 2)]
    assert [q for q in quoted if q in want] == want, (quoted, want)
    cell = _row('"prefix caching halves prefill" — shared system prompt = 90% of each prompt')[0]
    for value in (round(pre["ttft_p50_cache_off"] * 1e3), round(pre["ttft_p50_cache_on"] * 1e3),
                  f"{pre['prefill_tokens_cache_off']:,}", pre["prefill_tokens_cache_on"],
                  round(pre["hit_rate"], 2), round(pre["ttft_p50_reduction"] * 100)):
        assert str(value) in cell, f"prefix row should quote {value}: {cell}"


def test_results_the_notebooks_read_are_committed():
    names = set()
    for nb in (ROOT / "notebooks").rglob("*.ipynb"):
        text = nb.read_text(encoding="utf-8")
        names |= set(re.findall(r'\\"results\\" / \\"([\w.-]+\.json)\\"', text))
        names |= {f"{n}.json" for n in re.findall(r'load_result\(\\"([\w.-]+)\\"\)', text)}
    assert names, "expected the notebooks to read committed results"
    missing = sorted(n for n in names if not (RESULTS / n).exists())
    assert not missing, f"notebooks read datasets/results/{missing}, which is not committed"


def test_lora_router_paragraph_matches_its_json():
    """The Multi-LoRA section's "Routing adapters" paragraph quotes lora_router.json."""
    d = _result("lora_router")
    text = " ".join(README.split("**Routing adapters.**", 1)[1].split("\n\n", 1)[0].split())
    by = {r["policy"]: r for r in d["rows"]}
    for label, key in (("round-robin", "round-robin"), ("least-outstanding", "least-outstanding"),
                       ("adapter-affinity", "adapter-affinity"),
                       ("`min_load=4`", "adapter-affinity min_load=4"),
                       ("unbounded", "adapter-affinity unbounded")):
        assert f"{label} {by[key]['loads_per_request']:.3f}" in text, (label, text)
    assert f"({d['affinity_vs_round_robin']:.1f}x fewer)" in text
    assert f"{d['setup']['num_requests']:,} requests" in text
    assert (f"a peak of {by['adapter-affinity unbounded']['peak_outstanding']} requests on one "
            f"replica against {by['adapter-affinity']['peak_outstanding']}") in text
