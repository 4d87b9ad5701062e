"""``labkit bench step``: where a decode step's time goes, and what each cure buys, in one run.

Side by side, in interleaved rounds (every round runs every variant once, alternating order, so
a slow phase of the machine hits all of them), at decode batch 1, 8 and 32:

=================  ==========================================================================
eager              the engine as it ships
fused              ``LLM(fused=True)``: q|k|v, gate|up, residual add in the norm, rotary table
compiled           ``LLM(compile=True)``: inductor; decode steps one full graph each, other
                   steps piecewise around attention
fused+piecewise    fused, and ``compile=True, compile_mode="piecewise"``: every step piecewise
                   (what the full decode graphs buy is fused+compiled over this)
fused+compiled     both
python-wrapper     fused+compiled with ``compile_wrapper="python"``: the full graphs' kernels
                   called from inductor's Python module, not one C++ call (what that buys)
overlap            ``LLM(async_scheduling=True)``: step N+1 scheduled (and N-1 detokenised)
                   by a host thread while N's forward runs (:mod:`labkit.engine.overlap`)
all                fused + compiled + overlap
=================  ==========================================================================

Each variant reports decode tokens/s (sequences / mean decode-step wall time), its ratio to
eager at the same batch, and the step profiler's phases (:mod:`labkit.engine.profiler`, phases
only: per-module hooks would cost the eager variants time the compiled pieces never pay) in
ms per step (with overlap the phases of the two threads run at once, so they add up to more
than the step and "other" is 0: the step's wall time is the measure). Every variant's greedy
tokens must equal eager's (``outputs_match``). The compiled
variants compile exactly the decode sizes measured (``compile_sizes`` = the batches; prefill
runs eager); their compile seconds are in ``compile``. Beside them:

* **llama.cpp** f32 on the same model exported to GGUF, batch 1, the same thread count (its
  own process, :mod:`labkit.bench.llamacpp`), one round after each of labkit's batch-1 rounds
  (interleaved: a slow phase of the machine hits both), or "llama.cpp: not installed".
* **weight reading at batch 1** (``gemv``, :mod:`labkit.bench.step_gemv`): GB/s of one pass
  over the model's linear weights as library matmuls and as the compiled pieces' dot products.
* **start-up**: a fresh interpreter's time to its first generated token through ``labkit.LLM``
  against a fresh interpreter that only runs ``import torch``, and where it went (interpreter,
  import torch, import labkit, the engine's imports, model load, engine build, first step).

The top-level keys ``batch1_vs_llamacpp``, ``batch32_vs_eager`` (``batch32_vs_eager_batch``:
the batch actually used, the largest run when 32 is not), ``startup_over_torch_import_s`` and
``outputs_match`` are the step's headline (:func:`headline`).

Numbers are the machine's: the JSON keeps the load average at the start (a busy machine's
ratios are not the lab's), and nothing here is asserted in a test but the shape of the result.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from labkit.bench.common import (
    bench_parser,
    environment,
    greedy_params,
    print_table,
    torch_threads,
    write_results,
)
from labkit.bench.step_gemv import thread_round_trip_us, weight_streaming
from labkit.engine.profiler import PHASES, StepProfiler

VARIANTS = {"eager": {}, "fused": {"fused": True}, "compiled": {"compile": True},
            "fused+piecewise": {"fused": True, "compile": True, "compile_mode": "piecewise"},
            "fused+compiled": {"fused": True, "compile": True},
            "python-wrapper": {"fused": True, "compile": True, "compile_wrapper": "python"},
            "overlap": {"async_scheduling": True},
            "all": {"fused": True, "compile": True, "async_scheduling": True}}
FULL = {"batches": [1, 8, 32], "prompt_len": 16, "new_tokens": 64, "rounds": 5,
        "startup_repeats": 3}
QUICK = {"batches": [1, 4], "prompt_len": 8, "new_tokens": 8, "rounds": 2, "startup_repeats": 1}


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Distinct seeded prompts (no prefix-cache hits between sequences)."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab, (batch, prompt_len), generator=g).tolist()


def _engines(model: str, batches: list[int]) -> dict[str, Any]:
    from labkit.engine.llm import LLM

    return {name: LLM(model, dtype="float32", max_num_seqs=max(batches),
                      compile_sizes=tuple(batches), **kw)
            for name, kw in VARIANTS.items()}


def _run(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list]:
    """One measured generate: the profiler's summary (prefill step left out) and the tokens."""
    prof = StepProfiler(layers=False).attach(llm.llm_engine)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy_params(new_tokens))
    finally:
        prof.detach()
    return prof.summary(skip=1), [o.outputs[0].token_ids for o in outs]


def _row(name: str, batch: int, runs: list[dict]) -> dict[str, Any]:
    """The median round (by step time) of one variant at one batch."""
    s = sorted(runs, key=lambda r: r["mean_step_ms"])[len(runs) // 2]
    n = max(1, s["num_steps"])
    return {"variant": name, "batch": batch,
            "decode_tok_s": 1e3 * batch / s["mean_step_ms"],
            "step_ms": s["mean_step_ms"], "cpu_step_ms": 1e3 * s["cpu_s"] / n,
            "phases_ms": {p: 1e3 * s["phases_s"][p] / n for p in PHASES},
            "share": dict(s["share"]), "rounds": len(runs),
            "step_ms_rounds": [r["mean_step_ms"] for r in runs]}


def measure(engines: dict[str, Any], cfg: dict[str, Any], vocab: int,
            after_round: Callable[[int], None] | None = None) -> tuple[list[dict], list[str]]:
    """Rows per (variant, batch) and a list of the variants whose tokens differ from eager's.
    ``after_round(batch)`` runs after each measured round (``run`` measures llama.cpp there,
    so its rounds meet the machine's slow phases as labkit's do)."""
    rows, mismatches = [], []
    names = list(engines)
    bar = tqdm(total=len(cfg["batches"]) * (cfg["rounds"] + 1), desc="bench step")
    for batch in cfg["batches"]:
        prompts = _prompts(batch, cfg["prompt_len"], vocab)
        tokens = {}
        for n in names:  # warm-up: compiles the compiled variants' decode size
            tokens[n] = _run(engines[n], prompts, cfg["new_tokens"])[1]
        bar.update(1)
        mismatches += [f"{n} at batch {batch}" for n in names if tokens[n] != tokens["eager"]]
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(cfg["rounds"]):
            for n in names if r % 2 == 0 else names[::-1]:
                runs[n].append(_run(engines[n], prompts, cfg["new_tokens"])[0])
            if after_round is not None:
                after_round(batch)
            bar.update(1)
        rows += [_row(n, batch, runs[n]) for n in names]
    bar.close()
    return rows, mismatches


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """decode tokens/s of each variant over eager's, per batch."""
    eager = {r["batch"]: r["decode_tok_s"] for r in rows if r["variant"] == "eager"}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["variant"] != "eager":
            out.setdefault(f"batch {r['batch']}", {})[r["variant"]] = \
                r["decode_tok_s"] / eager[r["batch"]]
    return out


class LlamaCppRounds:
    """llama.cpp f32 on the model exported to GGUF, batch 1, one speed round per call (its own
    process each time: a warm-up generation, then two measured), so :func:`measure` can
    interleave them with labkit's rounds."""

    def __init__(self, llm: Any, cfg: dict[str, Any], threads: int, workdir: Path) -> None:
        from labkit.bench.llamacpp import cpu_has_amx, find_llamacpp_python

        self.python, self.decode, self.ttft = find_llamacpp_python(), [], []
        self.threads = threads
        if self.python is None:
            return
        from labkit.quant.gguf_export import export_gguf

        f = workdir / "model-f32.gguf"
        export_gguf(llm.model, f, type="f32", tokenizer=llm.tokenizer, progress=False)
        prompt = _prompts(1, cfg["prompt_len"], llm.model.config.vocab_size)[0]
        self.request = {"model": str(f), "threads": threads, "n_ctx": 512,
                        "extra_bufts": not cpu_has_amx(),
                        "tasks": [{"kind": "speed", "prompt": prompt,
                                   "new_tokens": cfg["new_tokens"], "repeats": 3}]}

    def __call__(self, batch: int = 1) -> None:
        from labkit.bench.llamacpp import run_llamacpp

        if self.python is None or batch != 1:
            return
        s = run_llamacpp(self.request, self.python)["results"][0]
        # a fresh process's first generation is its warm-up (labkit's engines are warm too)
        self.decode += s["decode_tok_s"][1:]
        self.ttft += s["ttft_s"][1:]

    def result(self) -> dict[str, Any]:
        if self.python is None:
            return {"note": "llama.cpp: not installed"}
        return {"format": "f32 gguf", "batch": 1, "threads": self.threads,
                "decode_tok_s": statistics.median(self.decode),
                "ttft_ms": 1e3 * statistics.median(self.ttft),
                "decode_tok_s_rounds": self.decode, "interleaved": True}


# A fresh interpreter's way to its first token, with a wall-clock mark after each stage
# (time.time(): the parent's spawn time is on the same clock). The engine's modules and the
# loader are imported on their own so that LLM() splits into model load and engine build.
_CHILD = """import time; t0 = time.time()
import json, torch; torch.set_num_threads({threads}); t_torch = time.time()
import labkit; t_labkit = time.time()
import labkit.engine.llm, labkit.model.loader as loader; t_imports = time.time()
load, spent = loader.load_pretrained, []
def timed(*a, **k):
    t = time.time(); out = load(*a, **k); spent.append(time.time() - t); return out
loader.load_pretrained = timed
llm = labkit.LLM({model!r}, dtype='float32'); t_llm = time.time()
llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=labkit.SamplingParams(
    temperature=0, max_tokens=1, ignore_eos=True)); t_first = time.time()
print(json.dumps({{"marks": [t0, t_torch, t_labkit, t_imports, t_llm, t_first],
                  "load_s": sum(spent)}}))
"""
_BARE = "import json, time, torch; print(json.dumps({'marks': [time.time()]}))"
STAGES = ("interpreter", "import torch", "import labkit", "engine imports", "model load",
          "engine build", "first step")


def _spawn(code: str, env: dict[str, str]) -> list[float]:
    """Seconds from spawning ``code`` to each mark it prints (its last stdout line, JSON), then
    its ``load_s`` if it has one."""
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"start-up child failed ({r.returncode}): {r.stderr[-2000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return [m - t for m in d["marks"]] + ([d["load_s"]] if "load_s" in d else [])


def _stages(m: list[float]) -> dict[str, float]:
    """The child's marks as the time each stage took; they add up to the first token."""
    t0, torch_, labkit_, imports, llm, first, load = m  # load: a duration, not a mark
    return dict(zip(STAGES, (t0, torch_ - t0, labkit_ - torch_, imports - labkit_, load,
                             (llm - imports) - load, first - llm)))


def startup(model: str, threads: int, repeats: int) -> dict[str, Any]:
    """Seconds from spawning a fresh interpreter to (a) ``import torch`` done and (b) the first
    token of ``labkit.LLM(model).generate``, alternating, medians over ``repeats``; and where
    (b)'s time went, stage by stage (``STAGES``), in the run with the median first token.

    Bytecode is cached as in any lab venv (``PYTHONDONTWRITEBYTECODE`` is dropped for the
    children: torch ships its ``.pyc`` files, labkit's would otherwise be compiled afresh in
    every process), and one unmeasured spawn first writes them and warms the page cache."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OMP_NUM_THREADS"] = str(threads)
    child = _CHILD.format(threads=threads, model=model)
    _spawn(child, env)
    bare, full = [], []
    for r in range(repeats):
        for code in ((_BARE, child) if r % 2 == 0 else (child, _BARE)):
            (bare if code == _BARE else full).append(_spawn(code, env))
    bare_s = statistics.median(m[0] for m in bare)
    mid = sorted(full, key=lambda m: m[5])[len(full) // 2]
    ttft = statistics.median(m[5] for m in full)
    return {"import_torch_s": bare_s, "first_token_s": ttft,
            "first_token_over_import": ttft / bare_s, "over_torch_import_s": ttft - bare_s,
            # labkit's own share, free of import torch's swings from process to process
            "after_import_torch_s": statistics.median(m[5] - m[1] for m in full),
            "stages_s": _stages(mid), "repeats": repeats, "warmup_spawns": 1}


def headline(rows: list[dict], llama: dict[str, Any], start: dict[str, Any]
             ) -> dict[str, Any]:
    """The four numbers quoted for the step: every cure on ("all") over llama.cpp f32 at batch 1
    (None when llama.cpp or batch 1 is absent), "all" over eager at batch 32 (or, when 32 was
    not run, the largest batch that was: ``batch32_vs_eager_batch`` says which), and the first
    token's seconds above a bare ``import torch``. Beside both ratios, the fastest variant's
    (``*_best_*``): a cure that costs here, overlap on a CPU, pulls "all" below it."""
    tok = {(r["variant"], r["batch"]): r["decode_tok_s"] for r in rows}
    top = 32 if ("all", 32) in tok else max(b for _, b in tok)
    ll = llama.get("decode_tok_s")
    best = max((v for v, b in tok if b == 1), key=lambda v: tok[v, 1], default=None)
    best32 = max((v for v, b in tok if b == top), key=lambda v: tok[v, top])
    return {"batch1_vs_llamacpp": tok["all", 1] / ll if ll and ("all", 1) in tok else None,
            "batch1_best_variant": best,
            "batch1_best_vs_llamacpp": tok[best, 1] / ll if ll and best else None,
            "batch32_vs_eager": tok["all", top] / tok["eager", top],
            "batch32_best_variant": best32,
            "batch32_best_vs_eager": tok[best32, top] / tok["eager", top],
            "batch32_vs_eager_batch": top,
            "startup_over_torch_import_s": start["first_token_s"] - start["import_torch_s"]}


def run(model: str, cfg: dict[str, Any], threads: int) -> dict[str, Any]:
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    with torch_threads(threads):
        engines = _engines(model, cfg["batches"])
        vocab = engines["eager"].model.config.vocab_size
        with tempfile.TemporaryDirectory(prefix="labkit-step-") as d:
            llama_rounds = LlamaCppRounds(engines["eager"], cfg, threads, Path(d))
            rows, mismatches = measure(engines, cfg, vocab, after_round=llama_rounds)
            if 1 not in cfg["batches"]:  # no batch-1 rounds to interleave with
                for _ in range(cfg["rounds"]):
                    llama_rounds()
        llama = llama_rounds.result()
        gemv = weight_streaming(engines["eager"].model, rounds=cfg["rounds"] + 2,
                                passes=cfg["new_tokens"] // 4)
    compiled = {n: _compile_record(engines[n].compile_report) for n in engines
                if engines[n].compile_report is not None}
    start = startup(model, threads, cfg["startup_repeats"])
    return {**headline(rows, llama, start),
            "config": {**cfg, "model": model, "threads": threads, "variants": list(VARIANTS)},
            "loadavg_at_start": load_at_start, "rows": rows, "ratios": ratios(rows),
            "outputs_match": not mismatches, "mismatches": mismatches, "compile": compiled,
            "llama_cpp": llama, "gemv": gemv, "startup": start,
            "handoff_us": thread_round_trip_us(), "environment": environment()}


def _compile_record(rep: Any) -> dict[str, Any]:
    return {"compiled": rep.compiled, "reason": rep.reason, "backend": rep.backend,
            "compile_s": {str(k): v for k, v in rep.compile_s.items()},
            "total_s": rep.total_s, "eager_forwards": rep.eager_forwards,
            "graphs": rep.graphs, "full_attention": dict(rep.full_attention),
            "wrapper": rep.wrapper, "wrapper_reason": rep.wrapper_reason}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    """Decode tokens/s per batch and variant, and each (variant, batch)'s ms per step stacked
    by phase."""
    from plotly.subplots import make_subplots

    rows = payload["rows"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s",
                                                        "ms per decode step, by phase"))
    for v in payload["config"]["variants"]:
        mine = [r for r in rows if r["variant"] == v]
        fig.add_bar(x=[f"batch {r['batch']}" for r in mine], y=[r["decode_tok_s"] for r in mine],
                    name=v, offsetgroup=v, row=1, col=1)  # own offset group: side by side
    labels = [f"{r['variant']}<br>batch {r['batch']}" for r in rows]
    for p in PHASES:  # one offset group: the phases stack
        fig.add_bar(x=labels, y=[r["phases_ms"][p] for r in rows], name=p, row=1, col=2,
                    offsetgroup="phases", legendgroup="phases")
    fig.update_layout(barmode="relative", title=f"where a step's time goes: "
                      f"{payload['config']['model']}, {payload['config']['threads']} threads",
                      height=560, width=1500)
    fig.update_xaxes(type="category")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs="directory")


def report(payload: dict[str, Any]) -> None:
    print_table([{"variant": r["variant"], "batch": r["batch"], "tok/s": r["decode_tok_s"],
                  "ms/step": r["step_ms"], **{p: r["phases_ms"][p] for p in PHASES}}
                 for r in payload["rows"]])
    for b, rs in payload["ratios"].items():
        print(f"{b}: " + ", ".join(f"{v} {x:.2f}x eager" for v, x in rs.items()))
    for n, c in payload["compile"].items():
        print(f"{n}: " + (f"compiled {sorted(c['compile_s'])} in {c['total_s']:.1f} s"
                          if c["compiled"] else f"not compiled ({c['reason']})"))
    print("outputs match eager: " + ("yes" if payload["outputs_match"] else
                                     f"NO ({', '.join(payload['mismatches'])})"))
    ll = payload["llama_cpp"]
    print(ll.get("note") or f"llama.cpp f32 batch 1: {ll['decode_tok_s']:.1f} tok/s")
    g = payload["gemv"]
    print(f"reading the weights at batch 1 ({g['bytes'] / 2**20:.1f} MiB): library matmul "
          f"{g['linear_gb_s']:.1f} GB/s, compiled dot products {g['dot_gb_s']:.1f} GB/s "
          f"({g['dot_over_linear']:.2f}x)")
    s = payload["startup"]
    print(f"start-up: first token {s['first_token_s']:.2f} s from a fresh process, "
          f"{s['over_torch_import_s']:+.2f} s over a bare import torch "
          f"({s['import_torch_s']:.2f} s), {s['after_import_torch_s']:.2f} s after its own "
          "import torch; where it went: "
          + ", ".join(f"{k} {v:.2f}" for k, v in s["stages_s"].items()))
    b1 = payload["batch1_vs_llamacpp"]
    print(f"every cure on: {payload['batch32_vs_eager']:.2f}x eager at batch "
          f"{payload['batch32_vs_eager_batch']}, "
          + (f"{b1:.2f}x llama.cpp f32 at batch 1" if b1 is not None else
             "llama.cpp at batch 1 not measured"))
    if payload.get("batch1_best_vs_llamacpp") is not None:
        print(f"fastest at batch 1: {payload['batch1_best_variant']}, "
              f"{payload['batch1_best_vs_llamacpp']:.2f}x llama.cpp f32")
    print(f"fastest at batch {payload['batch32_vs_eager_batch']}: "
          f"{payload['batch32_best_variant']}, {payload['batch32_best_vs_eager']:.2f}x eager; "
          f"one hand-off to a worker thread and back: {payload['handoff_us']:.0f} us "
          "(what handing each forward to a worker thread would add to a step)")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("step", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, and llama.cpp's (default 1: on a shared machine a "
                   "second thread spin-waits on the first and the compiled kernels' OpenMP "
                   "regions suffer most)")
    a = p.parse_args(argv)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    payload = run(a.model, QUICK if a.quick else FULL, a.threads)
    report(payload)
    write_results(a.json, payload, write_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
