"""``labkit profile MODEL [--batch N] [--steps K] [--trace PATH]``: where a decode step's time
goes, phase by phase (:mod:`labkit.engine.profiler`), on this machine.

It runs ``--batch`` greedy requests of ``--steps`` new tokens each (one prefill step, then
decode steps at that batch size), skips the first step (prefill and warm-up), and prints each
phase's share of the step, wall and CPU, and the forward's split into attention, MLP, norms and
the LM head. ``--trace`` writes a Chrome/Perfetto trace of every step.
"""

from __future__ import annotations

import argparse
from typing import Any

from labkit.engine.profiler import LAYER_PARTS, PHASES


def run(model: str, batch: int, steps: int, prompt_len: int = 16, dtype: str = "float32",
        trace: str | None = None, fuse: bool = False, compile: bool = False,
        **engine: Any) -> dict[str, Any]:
    """Profile ``batch`` sequences decoding ``steps`` tokens; returns the summary. ``fuse``:
    ``LLM(fused=True)`` (q|k|v, gate|up, add + norm, rotary table: :mod:`labkit.model.fuse`);
    ``compile``: ``LLM(compile=True)`` (:mod:`labkit.engine.piecewise`)."""
    from labkit.engine.llm import LLM
    from labkit.engine.profiler import StepProfiler
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.loader import load_pretrained

    net, tok = load_pretrained(model, dtype=dtype)
    llm = LLM.from_model(net, tok, max_num_seqs=max(batch, 1), fused=fuse, compile=compile,
                         **engine)
    # compiled, phases only: the per-layer timers are module hooks, which the compiled pieces
    # never run and which keep decode steps out of the full graphs (a hook on the final norm)
    llm.profiler = StepProfiler(layers=not compile).attach(llm.llm_engine)
    tok = llm.tokenizer
    base = tok.encode("def fibonacci(n):\n    ") if tok is not None else [1]
    prompts = [(base * prompt_len)[:prompt_len] for _ in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    if compile:  # a first run builds the graphs of these sizes: compile time is not a step's
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        llm.profiler.steps.clear()
    llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    if trace:
        llm.profiler.export_chrome_trace(trace)
    return {**llm.profiler.summary(skip=1), "batch": batch, "model": model, "fused": fuse,
            "compile": str(llm.compile_report) if compile else None}


def report(s: dict[str, Any]) -> str:
    """The summary as the table ``labkit profile`` prints."""
    cures = [c for c, on in (("fused", s.get("fused")), (s.get("compile"), s.get("compile")))
             if on]
    lines = [f"{s['model']}{' (' + '; '.join(cures) + ')' if cures else ''}: batch "
             f"{s['batch']}, {s['num_steps']} decode steps, mean step "
             f"{s['mean_step_ms']:.2f} ms (CPU {1e3 * s['cpu_s'] / max(1, s['num_steps']):.2f} "
             "ms)", f"{'phase':<12}{'share':>8}{'ms/step':>10}"]
    for p in PHASES:
        lines.append(f"{p:<12}{s['share'][p]:>8.1%}"
                     f"{1e3 * s['phases_s'][p] / max(1, s['num_steps']):>10.3f}")
    if s.get("compile") and "not compiled" not in s["compile"]:
        # module hooks are not traced into the compiled graphs: the split would read ~0%
        lines.append("inside the forward: no split (the compiled graphs run no module hooks, "
                     "so none were set; profile without --compile for attention / MLP / "
                     "norms / LM head)")
    else:
        lines.append("inside the forward: " + ", ".join(
            f"{p} {s['layer_share_of_forward'][p]:.0%}" for p in LAYER_PARTS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="labkit profile", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="labkit-tiny")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=32, help="new tokens per sequence")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace")
    p.add_argument("--fuse", action="store_true",
                   help="LLM(fused=True): q|k|v, gate|up, add + norm, rotary table")
    p.add_argument("--compile", action="store_true",
                   help="LLM(compile=True): inductor, piecewise around attention")
    a = p.parse_args(argv)
    if a.batch < 1 or a.steps < 2 or a.prompt_len < 1:
        p.error("--batch and --prompt-len must be >= 1 and --steps >= 2 (the first step is "
                "the prefill, left out of the summary)")
    s = run(a.model, a.batch, a.steps, a.prompt_len, a.dtype, a.trace, a.fuse, a.compile)
    print(report(s))
    if a.trace:
        print(f"trace: {a.trace} (open in chrome://tracing or https://ui.perfetto.dev)")
    return 0
