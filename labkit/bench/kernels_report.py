"""The report of ``labkit bench kernels``: the issue's targets judged from a run, and markdown.

Kept apart from the measuring code so the bench module reads as "what is measured" only.
"""

from __future__ import annotations

from typing import Any

DECODE_TARGET = "paged decode >= 80% of copy bandwidth at B=64 x 4096"


def targets(b: Any) -> list[dict]:
    """The issue's targets, judged from this run's own rows; a target whose row is missing (its
    section failed or was not run) is listed as not met, with no value, never left out."""
    found: dict[str, dict] = {}
    for r in b.results:
        if r["kernel"] == "paged_attention_decode" and r["shape"].startswith("B=64 ctx=4096 "):
            found[DECODE_TARGET] = {"value": r.get("ratio_to_copy_bandwidth"),
                                    "met": (r.get("ratio_to_copy_bandwidth") or 0) >= 0.8}
        if (r["kernel"] in ("gptq_matmul", "awq_matmul")
                and r["shape"] == "M=1 K=8192 N=8192"):
            found[f"{r['kernel']} >= 2.5x fp16 at M=1 K=N=8192"] = {
                "value": r.get("speedup_vs_baseline"),
                "met": (r.get("speedup_vs_baseline") or 0) >= 2.5}
    names = [DECODE_TARGET] + [f"{k} >= 2.5x fp16 at M=1 K=N=8192"
                               for k in ("gptq_matmul", "awq_matmul")]
    return [{"target": n, **found.get(n, {"value": None, "met": False, "measured": False})}
            for n in names]


def to_markdown(payload: dict[str, Any]) -> str:
    """The report as markdown: targets, checks, then one table of results."""
    lines = [f"# labkit bench kernels — {payload['device']}", "",
             f"Copy bandwidth (device-to-device, read + write): "
             f"**{(payload['copy_gbps'] or 0):.0f} GB/s**.", "",
             "`ms` is device time per call: the median of CUDA-graph replays that run the call "
             "over enough copies of its large inputs to stream 256 MB (so L2 holds nothing "
             "useful), divided by the copies. `eager ms` is `triton.testing.do_bench` calling "
             "from Python, launch overhead included. Bandwidths and speedups use `ms`.", ""]
    if payload["targets"]:
        lines += ["| target | value | met |", "|---|---|---|"]
        for t in payload["targets"]:
            value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
            lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else 'no'} |")
        lines.append("")
    bad = [c for c in payload["checks"] if not c["ok"]]
    lines.append(f"Correctness checks: {len(payload['checks']) - len(bad)}/"
                 f"{len(payload['checks'])} within tolerance" + (
                     ": FAILED " + ", ".join(f"{c['kernel']} {c['shape']}" for c in bad)
                     if bad else "."))
    lines += ["", "| kernel | shape | ms | GB/s | of copy BW | TFLOP/s | baseline | baseline ms "
              "| speedup | eager ms | baseline eager ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    for r in payload["results"]:
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {f(r['ms'], '.4f')} | "
            f"{f(r.get('achieved_gbps'), '.0f')} | {f(r.get('ratio_to_copy_bandwidth'), '.0%')} | "
            f"{f(r.get('tflops'), '.1f')} | {r.get('baseline', '')} | "
            f"{f(r.get('baseline_ms'), '.4f')} | {f(r.get('speedup_vs_baseline'), '.2f')} | "
            f"{f(r.get('eager_ms'), '.4f')} | {f(r.get('baseline_eager_ms'), '.4f')} |")
    for e in payload["errors"]:
        lines.append(f"\nSection `{e['section']}` failed: `{e['error']}`")
    return "\n".join(lines) + "\n"
