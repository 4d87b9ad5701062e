"""``labkit bench quant``: what each weight format costs in accuracy and saves in bytes.

On the shipped model, side by side in one run: fp32, bf16, INT8 (W8A16), INT4 round-to-nearest,
GPTQ and AWQ (INT4, group 128), NF4, FP8 and fp32 weights with an INT8 KV cache. For each:
held-out perplexity, mean KL divergence of next-token distributions from fp32 (the damage done,
token by token), measured weight bytes next to the memory calculator's prediction, and CPU decode
tokens per CPU-second at batch 1 (labkit.bench.quant_speed): INT8, INT4 RTN, GPTQ and AWQ run
PyTorch's packed CPU kernels (``tokens_per_s``) and, for comparison, the dequantize-the-whole-
weight reference path (``tokens_per_s_dequant``); NF4 and FP8 only have the latter. labkit-tiny
is overhead-bound (``matmul_share``); ``--large`` adds a 116 M-parameter random-weight model
where decode is bandwidth-bound and fewer weight bytes pay.

Calibration windows come from the corpus's train split, evaluation windows from its held-out
split. labkit-tiny's FFN width 704 = 11 x 64 is not divisible by 128, so its down_proj falls back
to group 64 (recorded in the JSON); every other layer uses group 128.

The INT8 KV row's accuracy comes from the contiguous reference cache; ``engine_int8_kv`` runs the
same INT8 cache inside the paged engine (``kv_cache_dtype="int8"``) against fp32 KV with the same
byte budget: blocks, concurrency and throughput (labkit.bench.kv_int8_engine).
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, print_table, timed, write_json

QUICK = {"eval": (8, 128), "calib": (16, 128), "n_grid": 10, "search_batches": 2,
         "decode_tokens": 16, "rounds": 2,
         "engine_kv": {"prompts": 8, "prompt_len": 32, "max_tokens": 32, "auto_blocks": 8}}
FULL = {"eval": (64, 256), "calib": (128, 256), "n_grid": 20, "search_batches": 4,
        "decode_tokens": 32, "rounds": 3,
        "engine_kv": {"prompts": 16, "prompt_len": 64, "max_tokens": 64, "auto_blocks": 32}}
GROUP_SIZE = 128


def _evaluate(model, tokens, ref_lp, kv_cache_factory=None) -> dict[str, float]:
    from labkit.quant.evaluate import log_probs, mean_kl, perplexity_from_logprobs

    lp = log_probs(model, tokens, kv_cache_factory=kv_cache_factory)
    return {"perplexity": perplexity_from_logprobs(lp, tokens),
            "kl": mean_kl(ref_lp, lp) if ref_lp is not None else 0.0}


def _chart(rows: list[dict], path: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "held-out perplexity (lower is better)", "mean KL vs fp32 (log; fp32 = 0 not shown)"))
    positions = ["top center", "bottom center", "middle right", "middle left"]
    for i, r in enumerate(sorted(rows, key=lambda r: (r["weight_bytes"], r["perplexity"]))):
        x, pos = r["weight_bytes"] / 1e6, positions[i % len(positions)]
        kw = {"mode": "markers+text", "text": [r["format"]], "textposition": pos,
              "name": r["format"], "legendgroup": r["format"]}
        fig.add_trace(go.Scatter(x=[x], y=[r["perplexity"]], **kw), 1, 1)
        if r["kl"] > 0:
            fig.add_trace(go.Scatter(x=[x], y=[r["kl"]], showlegend=False, **kw), 1, 2)
    fig.update_xaxes(title_text="weight bytes (MB)")
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title="labkit-tiny: accuracy vs weight bytes", height=450, width=1000)
    fig.write_html(path, include_plotlyjs=True)
    print(f"wrote {path}")


def _builders(model, calib, s: dict, progress: bool) -> dict[str, tuple]:
    """format -> (bits, group, calculator format, build): every format built from the same fp32
    model and calibration windows, so the rows differ only in the format."""
    from labkit.quant import awq_quantize_model, gptq_quantize_model, quantize_model

    gs = {"group_size": GROUP_SIZE, "group_fallback": True}
    return {
        "fp32": (32, None, "fp32", lambda: model),
        "bf16": (16, None, "bf16", lambda: __import__("copy").deepcopy(model).to(torch.bfloat16)),
        "int8": (8, -1, "int8", lambda: quantize_model(model, "int8")),
        "int4_rtn": (4, GROUP_SIZE, "int4_rtn", lambda: quantize_model(model, "int4_rtn", **gs)),
        "gptq": (4, GROUP_SIZE, "gptq", lambda: gptq_quantize_model(
            model, calib, act_order=True, progress=progress, **gs)),
        "awq": (4, GROUP_SIZE, "awq", lambda: awq_quantize_model(
            model, calib, n_grid=s["n_grid"], search_batches=s["search_batches"],
            progress=progress, **gs)),
        "nf4": (4, 64, "nf4", lambda: quantize_model(model, "nf4", blocksize=64)),
        "fp8": (8, -1, "fp8", lambda: quantize_model(model, "fp8")),
    }


def _accuracy_rows(builders: dict[str, tuple], cfg, eval_tokens,
                   ref_lp) -> tuple[list[dict], dict, dict]:
    """(rows, quantizer reports, built models): each format's accuracy against fp32 and its
    measured bytes beside the memory calculator's prediction."""
    from labkit.quant.evaluate import model_bytes
    from labkit.quant.memory import estimate_memory, kv_cache_bytes

    rows, reports, built = [], {}, {}
    for name, (bits, group, calc_fmt, build) in builders.items():
        qm, t = timed(build)
        if isinstance(qm, tuple):
            qm, reports[name] = qm
        built[name] = qm
        qtime = t.wall_s
        metrics = _evaluate(qm, eval_tokens, None if name == "fp32" else ref_lp)
        base = "bf16" if name == "bf16" else "fp32"
        calc = estimate_memory(cfg, calc_fmt, base_dtype=base, group_size=GROUP_SIZE,
                               group_fallback=True).weight_bytes
        rows.append({"format": name, "bits": bits, "group_size": group, **metrics,
                     "weight_bytes": model_bytes(qm), "calculator_bytes": calc,
                     "kv_dtype": base, "kv_bytes_per_token": kv_cache_bytes(cfg, 1, 1, base),
                     "quantize_s": qtime})
        print(f"{name}: ppl {metrics['perplexity']:.4f} kl {metrics['kl']:.5f}", flush=True)
    return rows, reports, built


def _targets(rows: list[dict]) -> dict[str, bool]:
    """The claims the README makes about these formats, checked on this run's rows."""
    by = {r["format"]: r for r in rows}
    return {
        "gptq_beats_int4_rtn": by["gptq"]["perplexity"] < by["int4_rtn"]["perplexity"],
        "awq_beats_int4_rtn": by["awq"]["perplexity"] < by["int4_rtn"]["perplexity"],
        "int8_within_1pct_of_fp32":
            by["int8"]["perplexity"] <= 1.01 * by["fp32"]["perplexity"],
        "bytes_within_5pct_of_calculator": all(
            abs(r["weight_bytes"] - r["calculator_bytes"]) <= 0.05 * r["calculator_bytes"]
            for r in rows),
        "int8_decode_ge_1.0x_fp32": by["int8"]["speedup_vs_fp32"] >= 1.0,
        **{f"{f}_decode_ge_0.9x_fp32": by[f]["speedup_vs_fp32"] >= 0.9
           for f in ("int4_rtn", "gptq", "awq")},
    }


def _settings(model, s: dict) -> dict[str, Any]:
    """What the numbers were measured with, and the 7B sizes the calculator predicts."""
    from labkit.quant.memory import estimate_memory

    fallback = sorted({n.split(".", 3)[-1] for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and n != "lm_head"
                       and m.in_features % GROUP_SIZE})
    return {"eval_windows": s["eval"], "calibration_windows": s["calib"],
            "gptq": {"act_order": True, "damp": 0.01, "sym": False},
            "awq": {"n_grid": s["n_grid"], "clip": True, "duo_scaling": False,
                    "search_batches": s["search_batches"]},
            "group_size_64_fallback_layers": fallback,
            "llama2_7b_fp16_gb": estimate_memory("llama-2-7b", "fp16").weight_bytes / 1e9,
            "llama2_7b_int4_g128_gb": estimate_memory("llama-2-7b", "gptq").weight_bytes / 1e9}


def run(model_name: str = "labkit-tiny", quick: bool = False,
        progress: bool = True) -> dict[str, Any]:
    from labkit.bench.quant_speed import compare_decode, matmul_share
    from labkit.model.loader import load_pretrained
    from labkit.quant import Int8ContiguousKVCache
    from labkit.quant.calib import corpus_windows
    from labkit.quant.evaluate import log_probs
    from labkit.quant.memory import kv_cache_bytes

    s = QUICK if quick else FULL
    torch.manual_seed(0)
    model, tok = load_pretrained(model_name)
    cfg = model.config
    eval_tokens = corpus_windows(tok, "heldout", *s["eval"])
    calib = corpus_windows(tok, "train", *s["calib"], seed=0)
    ref_lp = log_probs(model, eval_tokens)
    prompt = eval_tokens[0, :16].tolist()
    rows, reports, built = _accuracy_rows(_builders(model, calib, s, progress), cfg, eval_tokens,
                                          ref_lp)
    speeds = compare_decode(built, prompt, s["decode_tokens"], s["rounds"])
    for r in rows:
        r.update(speeds[r["format"]])
        r["speedup_vs_fp32"] = r["tokens_per_s"] / speeds["fp32"]["tokens_per_s"]
    share = {n: matmul_share(built[n], speeds[n]["tokens_per_s"])
             for n in ("fp32", "int8", "int4_rtn")}
    kv = _evaluate(model, eval_tokens, ref_lp,
                   kv_cache_factory=lambda m, b, t: Int8ContiguousKVCache(m, b, t))
    rows.append({**rows[0], **kv, "format": "int8_kv", "kv_dtype": "int8",
                 "kv_bytes_per_token": kv_cache_bytes(cfg, 1, 1, "int8"),
                 "tokens_per_s": None, "speedup_vs_fp32": None, "quantize_s": 0.0})
    from labkit.bench.kv_int8_engine import run_engine_int8_kv

    e = s["engine_kv"]
    engine_kv = run_engine_int8_kv(model, [eval_tokens[i, :e["prompt_len"]].tolist() for i in
                                           range(min(e["prompts"], len(eval_tokens)))],
                                   e["max_tokens"], e["auto_blocks"])
    return {"model": model_name, "quick": quick, "results": rows, "targets": _targets(rows),
            "settings": _settings(model, s),
            "cpu_decode_matmul_share": share,
            "engine_int8_kv": engine_kv, "gptq_report": reports.get("gptq", []),
            "awq_report": reports.get("awq", []),
            "environment": environment()}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("quant", "accuracy vs bytes of INT8 / INT4 / GPTQ / AWQ / NF4 / FP8 and "
                              "an INT8 KV cache on the shipped model")
    p.add_argument("--model", default="labkit-tiny", help="shipped model name or folder")
    p.add_argument("--chart", metavar="HTML", help="write a plotly chart of accuracy vs bytes")
    p.add_argument("--large", action="store_true",
                   help="also decode a 116 M-parameter random-weight model (bandwidth-bound)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = run(args.model, args.quick)
    if args.large:
        from labkit.bench.quant_speed import run_large

        out["large_model"] = run_large(args.quick)
        out["targets"].update(out["large_model"]["targets"])
    print_table(out["results"], ["format", "bits", "group_size", "perplexity", "kl",
                                 "weight_bytes", "calculator_bytes", "tokens_per_s",
                                 "tokens_per_s_dequant", "speedup_vs_fp32"])
    for n, sh in out["cpu_decode_matmul_share"].items():
        print(f"{n}: linears {sh['linears_us_per_step']:.0f} us of a {sh['step_us']:.0f} us "
              f"decode step ({100 * sh['matmul_share']:.0f}%): the rest is per-op overhead")
    if args.large:
        print("116 M-parameter random-weight model, batch-1 decode:")
        print_table(out["large_model"]["rows"], ["format", "weight_bytes", "tokens_per_s",
                                                 "tokens_per_s_dequant", "speedup_vs_fp32"])
    e = out["engine_int8_kv"]
    print(f"paged engine, same KV budget ({e['kv_cache_bytes']} bytes), {e['num_prompts']} "
          f"greedy requests:")
    print_table(e["rows"], ["kv_cache_dtype", "kv_bytes_per_block", "num_blocks",
                            "mean_running", "num_preemptions", "tokens_per_cpu_s"])
    r8 = e["rows"][1]
    print(f"int8 engine == int8 reference: {r8['matches_int8_reference']}/{e['num_prompts']}; "
          f"identical to auto: {r8['identical_to_auto']}/{e['num_prompts']}")
    for k, ok in out["targets"].items():
        print(f"target {k}: {'PASS' if ok else 'FAIL'}")
    write_json(args.json, out)
    if args.chart:
        _chart(out["results"], args.chart)
    return 0
