"""``labkit bench step-gpu``: a decode step's time on a GPU, with and without CUDA graphs.

Issue 31's GPU item, run by ``.ci/gpu``'s ``step`` when a GPU is lent. At decode batch 1 and 64,
side by side in interleaved rounds (:func:`labkit.bench.step.measure`, the CPU bench's loop),
on one CUDA device:

=================  ==========================================================================
eager              the engine as it ships: every op launched from Python
compiled           ``LLM(compile=True, cuda_graphs=False)``: inductor's Triton kernels, decode
                   steps as one full graph each, its kernels launched by the host every step
cuda-graphs        ``LLM(compile=True)``: the same full graphs captured as CUDA graphs
                   (:mod:`labkit.engine.cuda_graph`), one replay per step
=================  ==========================================================================

A step's wall time is the measure (sampling reads the tokens back, so each step ends with the
GPU done). labkit-tiny is launch-bound on any GPU: its kernels finish faster than a host issues
them, which is the case CUDA graphs are for. ``--model`` takes a local checkpoint for a
model-sized step. Every variant's greedy tokens must equal eager's (``outputs_match``).
Without a CUDA device it refuses by name (exit 2): there is nothing to measure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, print_table, write_json
from labkit.bench.step import measure

VARIANTS = {"eager": {}, "compiled": {"compile": True, "cuda_graphs": False},
            "cuda-graphs": {"compile": True}}
FULL = {"batches": [1, 64], "prompt_len": 16, "new_tokens": 64, "rounds": 5}
QUICK = {"batches": [1, 8], "prompt_len": 8, "new_tokens": 16, "rounds": 2}


def engines(model: str, batches: list[int], dtype: str) -> dict[str, Any]:
    from labkit.engine.llm import LLM

    return {name: LLM(model, device="cuda", dtype=dtype, max_num_seqs=max(batches),
                      compile_sizes=tuple(batches), **kw) for name, kw in VARIANTS.items()}


def headline(rows: list[dict]) -> dict[str, Any]:
    """Step ms per variant and batch, and CUDA graphs' speed-up over the compiled launches and
    over eager at each batch."""
    ms = {(r["variant"], r["batch"]): r["step_ms"] for r in rows}
    out: dict[str, Any] = {"step_ms": {f"{v} b{b}": t for (v, b), t in ms.items()}}
    for b in sorted({b for _, b in ms}):
        out[f"b{b}_cuda_graphs_over_compiled"] = ms["compiled", b] / ms["cuda-graphs", b]
        out[f"b{b}_cuda_graphs_over_eager"] = ms["eager", b] / ms["cuda-graphs", b]
    return out


def run(model: str, cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    llms = engines(model, cfg["batches"], dtype)
    vocab = llms["eager"].model.config.vocab_size
    rows, mismatches = measure(llms, cfg, vocab)
    reports = {n: str(llm.compile_report) for n, llm in llms.items() if llm.compile_report}
    return {**headline(rows), "outputs_match": not mismatches, "mismatches": mismatches,
            "config": {**cfg, "model": model, "dtype": dtype, "variants": list(VARIANTS)},
            "loadavg_at_start": load_at_start, "rows": rows, "compile": reports,
            "device": torch.cuda.get_device_name(), "environment": environment()}


def report(payload: dict[str, Any]) -> None:
    print_table([{"variant": r["variant"], "batch": r["batch"], "ms/step": r["step_ms"],
                  "tok/s": r["decode_tok_s"]} for r in payload["rows"]])
    for k, v in payload.items():
        if k.endswith("_over_compiled") or k.endswith("_over_eager"):
            print(f"{k}: {v:.2f}x")
    print(f"outputs match eager: {'yes' if payload['outputs_match'] else payload['mismatches']}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("step-gpu", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("labkit bench step-gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the CPU's step is `labkit bench step`", file=sys.stderr)
        return 2
    payload = run(a.model, QUICK if a.quick else FULL, a.dtype)
    report(payload)
    write_json(a.json, payload)
    return 0 if payload["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
