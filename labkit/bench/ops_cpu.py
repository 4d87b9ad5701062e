"""``labkit bench ops cpu-tuning``: threads and step token budget on this CPU, beside llama.cpp.

Two knobs decide a CPU deployment's speed before any kernel work. **Threads**: each matmul is
split over ``torch.get_num_threads()`` OpenMP threads; past the physical cores they
oversubscribe, and a thread descheduled mid-matmul leaves the others spin-waiting at the
barrier, so throughput does not plateau, it falls. **The step's token budget**
(``max_num_batched_tokens``, the chunk size of chunked prefill): a bigger chunk makes bigger,
more efficient matmuls for prefill, but every decode in the same step waits for it.

Each thread count runs in a fresh process (``OMP_NUM_THREADS`` and ``torch.set_num_threads``,
from 1 to twice the cores): labkit's prefill tokens/s (one prompt), decode tokens/s at batch 1
and 8, and llama.cpp's prefill and batch-1 decode on the same model exported to GGUF f32
(llama-cpp-python, when installed: ``tests/quant/run_llamacpp.sh``). Then, at as many threads
as cores, the budget from 64 to 1024: prefill tokens/s of a batch of prompts and the decode
gap (ITL) of requests decoding beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"prompt_len": 256, "new_tokens": 32, "repeats": 2, "budgets": [64, 256, 1024],
         "mixed_prompts": 4, "mixed_prompt_len": 384, "mixed_decoders": 4}
FULL = {**QUICK, "prompt_len": 512, "new_tokens": 64, "repeats": 3,
        "budgets": [64, 128, 256, 512, 1024], "mixed_prompts": 8}
MODEL = "labkit-tiny"


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1, *rng.integers(5, 4000, n - 1).tolist()]


def _llm(**kw: Any) -> Any:
    from labkit import LLM

    return LLM(MODEL, dtype="float32", num_blocks=1024, max_num_seqs=32, **kw)


def _tok_s(llm: Any, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    """Generated (or prompt, with max_tokens=1) tokens per second, median of ``repeats``."""
    from labkit.bench.common import greedy_params

    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=greedy_params(max_tokens))
        dt = time.perf_counter() - t
        n = sum(len(p) for p in prompts) if max_tokens == 1 else len(prompts) * max_tokens
        rates.append(n / dt)
    return float(np.median(rates))


def thread_worker(threads: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: labkit's prefill and decode speed at ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=2048)
    p = _prompt(cfg["prompt_len"])
    _tok_s(llm, [p], 2, 1)  # warm-up
    return {"threads": threads,
            "labkit_prefill_tok_s": _tok_s(llm, [p], 1, cfg["repeats"]),
            "labkit_decode_b1_tok_s": _tok_s(llm, [p[:16]], cfg["new_tokens"], cfg["repeats"]),
            "labkit_decode_b8_tok_s": _tok_s(llm, [_prompt(16, s) for s in range(8)],
                                             cfg["new_tokens"], cfg["repeats"])}


def budget_worker(budget: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Prefill throughput of a batch of prompts, and the decode gaps of requests already
    decoding while those prompts are prefilled in chunks of ``budget`` tokens."""
    from labkit.bench.common import greedy_params

    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=budget)
    eng = llm.llm_engine
    long = [_prompt(cfg["mixed_prompt_len"], 100 + i) for i in range(cfg["mixed_prompts"])]
    prefill = _tok_s(llm, long, 1, cfg["repeats"])
    for i in range(cfg["mixed_decoders"]):
        eng.add_request(f"d{i}", _prompt(16, 200 + i), greedy_params(10_000))
    for _ in range(3):
        eng.step()  # the decoders are running
    for i, p in enumerate(long):
        eng.add_request(f"p{i}", p, greedy_params(1))
    gaps, t = [], time.perf_counter()
    while not all(eng.requests[f"p{i}"].is_finished for i in range(len(long))):
        eng.step()
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    eng.abort([f"d{i}" for i in range(cfg["mixed_decoders"])])
    return {"budget": budget, "prefill_tok_s": prefill, "steps": len(gaps),
            "decode_itl_p50_ms": 1e3 * float(np.median(gaps)),
            "decode_itl_max_ms": 1e3 * float(np.max(gaps))}


def _spawn(kind: str, arg: int, cfg: dict[str, Any], threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    req = json.dumps({"kind": kind, "arg": arg, "cfg": cfg})
    res = subprocess.run([sys.executable, "-m", "labkit.bench.ops_cpu", "--worker", req],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"cpu-tuning worker {kind}={arg} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _llamacpp(threads: int, cfg: dict[str, Any], gguf: Path, python: str) -> dict[str, Any]:
    from labkit.bench.llamacpp import LlamaCppCrashed, cpu_has_amx, run_llamacpp

    p = _prompt(cfg["prompt_len"])
    req = {"model": str(gguf), "threads": threads, "n_ctx": 1024,
           "extra_bufts": not cpu_has_amx(),
           "tasks": [{"kind": "speed", "prompt": p, "new_tokens": cfg["new_tokens"],
                      "repeats": cfg["repeats"]}]}
    try:
        s = run_llamacpp(req, python)["results"][0]
    except LlamaCppCrashed as e:
        return {"llamacpp_error": e.signal}
    return {"llamacpp_prefill_tok_s": len(p) / float(np.median(s["ttft_s"])),
            "llamacpp_decode_b1_tok_s": float(np.median(s["decode_tok_s"]))}


def _gguf(workdir: Path) -> Path:
    from labkit.model.loader import load_pretrained
    from labkit.quant.gguf_export import export_gguf

    model, tok = load_pretrained(MODEL)
    out = workdir / "labkit-tiny-f32.gguf"
    export_gguf(model, out, type="f32", tokenizer=tok, progress=False)
    return out


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from labkit.bench.llamacpp import find_llamacpp_python

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    cores = os.cpu_count() or 1
    python = find_llamacpp_python()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _gguf(Path(tmp)) if python else None
        for n in tqdm(range(1, 2 * cores + 1), desc="threads"):
            row = _spawn("threads", n, cfg, n)
            if python:
                row.update(_llamacpp(n, cfg, gguf, python))
            rows.append(row)
    budgets = [_spawn("budget", b, cfg, cores) for b in tqdm(cfg["budgets"], desc="budget")]
    best = max(rows, key=lambda r: r["labkit_decode_b8_tok_s"])
    over = [r for r in rows if r["threads"] > cores]
    at_cores = next(r for r in rows if r["threads"] == cores)
    return {"benchmark": "ops cpu-tuning", "quick": quick, "config": cfg, "cores": cores,
            "model": MODEL, "threads": rows, "budgets": budgets,
            "best_threads_decode_b8": best["threads"],
            "oversubscribed_over_cores_decode_b8": (
                min(r["labkit_decode_b8_tok_s"] for r in over)
                / at_cores["labkit_decode_b8_tok_s"]) if over else None,
            "llama_cpp": "llama-cpp-python" if python else "not installed "
                         "(tests/quant/run_llamacpp.sh builds it)",
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=("tokens/s by thread count",
                                              "step token budget (threads = cores)"))
    t = payload["threads"]
    for key in ("labkit_prefill_tok_s", "labkit_decode_b1_tok_s", "labkit_decode_b8_tok_s",
                "llamacpp_prefill_tok_s", "llamacpp_decode_b1_tok_s"):
        if key in t[0]:
            fig.add_scatter(x=[r["threads"] for r in t], y=[r[key] for r in t], name=key,
                            row=1, col=1)
    b = payload["budgets"]
    fig.add_scatter(x=[r["budget"] for r in b], y=[r["prefill_tok_s"] for r in b],
                    name="prefill tok/s", row=1, col=2)
    fig.add_scatter(x=[r["budget"] for r in b], y=[r["decode_itl_max_ms"] for r in b],
                    name="decode ITL max (ms)", row=1, col=2)
    fig.add_vline(x=payload["cores"], line_dash="dot", row=1, col=1)
    fig.update_xaxes(type="log", row=1, col=2)
    fig.update_layout(title=f"CPU tuning on {payload['cores']} cores ({payload['model']})")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        a = json.loads(argv[1])
        fn = thread_worker if a["kind"] == "threads" else budget_worker
        print(json.dumps(fn(a["arg"], a["cfg"])))
        return 0
    args = bench_parser("ops cpu-tuning", __doc__.splitlines()[0]).parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["threads"])
    print_table(payload["budgets"])
    write_results(args.json, payload, write_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
