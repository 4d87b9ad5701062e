"""``labkit bench serve``: load-test an OpenAI-compatible server and compare with in-process.

Against ``--base-url`` (any OpenAI-compatible server), or, without it, a ``labkit serve`` child
process it starts and stops itself. In one run:

1. **rate sweep**: Poisson (or gamma, ``--burstiness``) arrivals at fractions of the capacity
   its all-at-once burst measured first (or at each ``--rates`` value); TTFT,
   TPOT, ITL and E2E percentiles against the achieved throughput: the latency knee;
2. **fixed concurrency** (16): the headline numbers, under vLLM ``benchmark_serving`` field
   names, beside ``in_process_output_throughput``: the same requests through ``LLM.generate``
   in this process. ``http_over_in_process`` is what HTTP, JSON and SSE cost;
3. **concurrency 1**: client TTFT p50 beside the engine's own TTFT for the same prompts;

   2 and 3 run against one own server per ``--engine-modes`` x ``--engine-threads`` variant
   (the engine loop in a thread of the server or in its own process, vLLM's EngineCore; 1 or 2
   torch threads), one after the other. The headline fields (``engine_mode``,
   ``engine_threads``, ``http_over_in_process``, ``c1_ttft_overhead_ms``) are the first
   variant's; ``engine_modes[mode][threads]`` has every variant's. The in-process baseline runs
   with each thread count too and keeps its best (``in_process_threads``): no variant is
   compared with a handicapped baseline;
4. **the knee beside the simulator** (with the in-process run): the same sweep through
   ``labkit.sim``'s engine on a step time fitted to this run's engine (:mod:`serve_knee`);
   ``knee`` = measured and simulated capacity, their ratio, and the fit;
5. **noisy neighbour** (own servers only): a light tenant alone, then under a heavy tenant that
   sends 10x its load, on a server with ``--policy fcfs`` and one with ``--policy fair``;
   ``fairness = {fcfs,fair}_light_p99_ttft_ratio`` = light p99 TTFT with the neighbour / alone.
   The heavy rate is ``overload`` (2) x the capacity the fcfs server measured in this run, so
   the heavy tenant saturates the server on a fast machine as on a slow or loaded one; the run
   checks that it did (:mod:`labkit.bench.saturation`: a queue formed, the heavy backlog grew),
   pushes harder if not, and reports ``fairness.verdict`` = ``inconclusive: why`` rather than
   a ratio that tested nothing. ``knee.verdict`` does the same for the sweep.

Absolute numbers are for this machine only; the ratios are the result.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, write_json
from labkit.bench.serve_client import BenchRequest, make_requests, summarize
from labkit.bench.serve_client import load as _load
from labkit.bench.serve_knee import fit_step_time, knee_report, simulate_rate
from labkit.bench.serve_report import print_report, write_chart

# The sweep's rates are fractions of the capacity this run measures first (its all-at-once
# burst): fixed rates missed the knee on a fast machine (issue 27: 4 and 8 req/s against 14.4 of
# capacity, so the "knee" was never reached). ``--rates`` still takes absolute req/s.
QUICK = {"num_requests": 24, "max_tokens": 64, "rate_fractions": (0.3, 0.7, 1.0, 1.5),
         "concurrency": 16, "conc_requests": 64, "c1_requests": 16, "light_n": 40,
         "heavy_mult": 10, "overload": 2.0, "fair_max_num_seqs": 4, "fair_max_tokens": 16}
FULL = {"num_requests": 96, "max_tokens": 64, "rate_fractions": (0.2, 0.4, 0.6, 0.8, 1.0, 1.5),
        "concurrency": 16, "conc_requests": 192, "c1_requests": 16, "light_n": 40,
        "heavy_mult": 10, "overload": 2.0, "fair_max_num_seqs": 4, "fair_max_tokens": 24}
SERVER_ARGS = ["--max-num-seqs", "16", "--num-blocks", "512", "--dtype", "float32"]
ENGINE_MODES = "process,thread"  # the first is the headline: labkit serve's default mode


def default_engine_threads() -> str:
    """``--engine-threads``' default: torch's own count first (what ``labkit serve`` uses
    when not told; it follows OMP_NUM_THREADS, else the cores), then 1."""
    import torch

    return ",".join(dict.fromkeys([str(torch.get_num_threads()), "1"]))


def engine_args(mode: str, threads: int) -> list[str]:
    """``labkit serve`` flags for an engine loop in a ``mode`` (thread | process) with
    ``threads`` torch threads."""
    if mode not in ("thread", "process"):
        raise ValueError(f"--engine-modes: {mode!r} is not thread or process")
    return ["--engine-threads", str(threads), "--engine-mode", mode]


def in_process(model_path: str, reqs: list[BenchRequest], max_num_seqs: int,
               threads: int = 1) -> dict[str, Any]:
    """The same requests through ``LLM.generate`` (throughput) and one at a time (TTFT), with
    ``threads`` torch threads (run() tries each setting the servers get and keeps the best)."""
    import torch

    from labkit import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model_path, max_num_seqs=max_num_seqs, num_blocks=512, dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    prompts = [r.prompt for r in reqs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    eng = llm.llm_engine
    ttfts = []
    for i, r in enumerate(reqs[:8]):
        t0 = time.perf_counter()
        eng.add_request(f"ttft-{i}", r.prompt, params[i])
        first = None
        while eng.has_unfinished_requests():
            got = eng.step()
            if first is None and got:
                first = time.perf_counter() - t0
        ttfts.append(first)
    return {"output_throughput": n / wall, "wall_s": wall, "output_tokens": n,
            "median_ttft_ms": float(np.median(ttfts)) * 1000,
            "texts": [o.outputs[0].text for o in outs],
            "step_fit": fit_step_time(eng.trace.steps),  # the simulator's clock (serve_knee)
            "prompt_ids": [list(o.prompt_token_ids) for o in outs],
            "vocab_size": eng.vocab_size}


def noisy_neighbour_steps(model: Any, tokenizer: Any = None, policy: str = "fcfs",
                          steps: int = 400, max_num_seqs: int = 4,
                          horizon: int = 160) -> dict[str, Any]:
    """The noisy neighbour in process, counted in engine steps (no clocks, so it is the same
    on any machine): a heavy tenant adds a request every 2 steps, a light one every 20 (10x
    less) until step ``horizon``; returns each light request's wait, in steps, from arrival to
    its first token."""
    from labkit.engine.llm_engine import LLMEngine
    from labkit.engine.sampling_params import SamplingParams

    eng = LLMEngine.from_model(model, tokenizer, block_size=16, num_blocks=256,
                               max_num_seqs=max_num_seqs, policy=policy)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    added: dict[str, int] = {}
    first: dict[str, int] = {}
    for step in range(steps):
        if step % 2 == 0 and step < horizon:
            rid = f"heavy{step // 2}"
            eng.add_request(rid, [1 + step % 50] * 12, sp, cache_salt="heavy")
            added[rid] = step
        if step % 20 == 0 and step < horizon:
            rid = f"light{step // 20}"
            eng.add_request(rid, [2 + step // 20] * 12, sp, cache_salt="light")
            added[rid] = step
        for o in eng.step():
            first.setdefault(o.request_id, step)
        if step >= horizon and not eng.has_unfinished_requests():
            break
    waits = {r: first[r] - added[r] for r in added}
    return {"policy": policy, "light_waits": [w for r, w in waits.items() if r[0] == "l"],
            "heavy_waits": [w for r, w in waits.items() if r[0] == "h"],
            "num_preemptions": eng.stats()["num_preemptions"], "engine": eng}


def _http_pass(url: str, model: str, conc_reqs: list, c1_reqs: list, cfg: dict[str, Any],
               slo: dict, bar: Any) -> tuple[dict, dict, list[str]]:
    """Fixed concurrency 16 (throughput), then concurrency 1 (TTFT), against one server."""
    res, dur = _load(url, model, conc_reqs, bar, max_concurrency=cfg["concurrency"])
    res1, dur1 = _load(url, model, c1_reqs, bar, max_concurrency=1)
    return summarize(res, dur, slo), summarize(res1, dur1, slo), [r.text for r in res]


def _variant_row(conc: dict, c1: dict, texts: list[str], ip: dict[str, Any]) -> dict[str, Any]:
    return {"output_throughput": conc["output_throughput"],
            "http_over_in_process": conc["output_throughput"] / ip["output_throughput"],
            "median_tpot_ms": conc["median_tpot_ms"], "p99_itl_ms": conc["p99_itl_ms"],
            "c1_median_ttft_ms": c1["median_ttft_ms"],
            "c1_ttft_overhead_ms": c1["median_ttft_ms"] - ip["median_ttft_ms"],
            "greedy_text_matches": sum(a == b for a, b in zip(texts, ip["texts"]))}


def _sweep(url: str, args: Any, reqs: list, cfg: dict[str, Any], bar: Any,
           slo: dict[str, float]) -> list[dict[str, Any]]:
    """The rate sweep, in order of offered rate. Without ``--rates``: the all-at-once burst
    first, whose throughput is the capacity, then ``rate_fractions`` of it (so a knee lies
    inside the sweep on any machine); ``cfg["rates"]`` is set to the rates used."""
    def one(rate: float) -> dict[str, Any]:
        res, dur = _load(url, args.model, reqs, bar, rate=rate, burstiness=args.burstiness,
                         seed=args.seed)
        return {"request_rate": rate, **summarize(res, dur, slo)}

    if "rates" in cfg:
        return [one(r) for r in cfg["rates"]]
    burst = one(math.inf)
    cap = burst["request_throughput"] or 1.0
    rows = [one(round(f * cap, 2)) for f in cfg["rate_fractions"]] + [burst]
    cfg["rates"] = tuple(r["request_rate"] for r in rows)
    return rows


def run(args: Any) -> dict[str, Any]:
    cfg = _config(args)
    # the concurrency run has its own, longer list (a few seconds of full batches, so the
    # ratio is not the ramp-up and the tail); the sweep's requests are its first ones
    conc_reqs = make_requests(max(cfg["conc_requests"], cfg["num_requests"]),
                              cfg["max_tokens"], args.dataset)
    reqs = conc_reqs[:cfg["num_requests"]]
    own = args.base_url is None
    modes = args.engine_modes.split(",")
    threads = [int(t) for t in args.engine_threads.split(",")]
    # own servers: every (mode, threads) variant, the first one is the headline and also runs
    # the sweep (and the noisy neighbour); --base-url: that server, once
    variants = [(m, t) for m in modes for t in threads] if own else [(None, None)]
    if own:
        for m, t in variants:
            engine_args(m, t)  # a bad mode fails before anything starts
    bar = tqdm(total=_total_requests(cfg, len(conc_reqs), len(variants), own and args.fairness),
               desc="bench serve", unit="req")
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    by_t = {}  # the baseline first, right before the headline server: the load drifts less
    if own or args.in_process:
        by_t = {t: in_process(args.model_path, conc_reqs, 16, t) for t in threads}
    passes, sweep = _http_passes(args, variants, reqs, conc_reqs, cfg, bar, slo)
    head_mode, head_threads = variants[0]
    conc, c1, http_texts = passes[variants[0]]
    payload: dict[str, Any] = {"backend": "labkit" if own else "openai-compatible",
                               "base_url": args.base_url, "model": args.model,
                               "engine_mode": head_mode, "engine_threads": head_threads,
                               "max_concurrency": cfg["concurrency"], **conc,
                               "slo_ms": slo, "concurrency_1": c1, "sweep": sweep}
    if by_t:
        ip = _beside_in_process(payload, by_t, conc, c1, http_texts)
        if own:  # every variant against the same (best) baseline
            payload["engine_modes"] = {m: {str(t): _variant_row(*passes[(m, t)], ip)
                                           for t in threads} for m in modes}
        sim = [simulate_rate(ip["step_fit"], ip["prompt_ids"][:len(reqs)],
                             [r.max_tokens for r in reqs],
                             rate, args.burstiness, args.seed, vocab_size=ip["vocab_size"])
               for rate in cfg["rates"]]
        payload["simulated_sweep"] = sim
        payload["knee"] = knee_report(sweep, sim, ip["step_fit"])
    if own and args.fairness:
        from labkit.bench.serve_fairness import fairness

        payload["fairness"] = fairness(args.model_path, cfg, bar,
                                       tuple(engine_args(head_mode, head_threads)))
    bar.close()
    payload["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
    payload["environment"] = environment()
    return payload


def _config(args: Any) -> dict[str, Any]:
    """The run's sizes: the quick or full preset, with ``--num-requests`` and ``--rates``."""
    cfg = dict(QUICK if args.quick else FULL)
    if args.num_requests:
        cfg["num_requests"] = args.num_requests
    if args.rates:
        cfg["rates"] = tuple(float(r) for r in args.rates.split(","))
    return cfg


def _total_requests(cfg: dict[str, Any], conc_n: int, n_variants: int, fair: bool) -> int:
    """Every request the run will send (the progress bar's length): the sweep, each variant's
    two passes, and the noisy neighbour's if it runs."""
    n_rates = len(cfg["rates"]) if "rates" in cfg else 1 + len(cfg["rate_fractions"])
    per_pass = conc_n + cfg["c1_requests"]
    return (cfg["num_requests"] * n_rates + per_pass * n_variants
            + (8 * cfg["fair_max_num_seqs"] + 2 * cfg["light_n"] * (2 + cfg["heavy_mult"])
               if fair else 0))


def _http_passes(args: Any, variants: list, reqs: list, conc_reqs: list, cfg: dict[str, Any],
                 bar: Any, slo: dict[str, float]) -> tuple[dict, list[dict[str, Any]]]:
    """Each variant's server in turn (own servers started and stopped here): its two passes,
    and on the first one the rate sweep."""
    from labkit.serve.process import ServerProcess

    own = args.base_url is None
    passes, sweep = {}, []
    for i, (mode, nt) in enumerate(variants):
        srv = ServerProcess(args.model_path, SERVER_ARGS + engine_args(mode, nt),
                            threads=nt).start() \
            if own else None
        url = args.base_url or srv.url
        try:
            _load(url, args.model, reqs[:2], None)  # warm-up
            if i == 0:
                sweep = _sweep(url, args, reqs, cfg, bar, slo)
            passes[(mode, nt)] = _http_pass(url, args.model, conc_reqs,
                                            reqs[:cfg["c1_requests"]], cfg, slo, bar)
        finally:
            if srv is not None:
                srv.stop()
    return passes, sweep


def _beside_in_process(payload: dict[str, Any], by_t: dict[int, dict[str, Any]], conc: dict,
                       c1: dict, http_texts: list[str]) -> dict[str, Any]:
    """The headline against the in-process baseline at its best thread count (throughput and
    TTFT each); returns that best baseline."""
    t_tp = max(by_t, key=lambda t: by_t[t]["output_throughput"])  # the baseline's best
    t_ttft = min(by_t, key=lambda t: by_t[t]["median_ttft_ms"])
    ip = {**by_t[t_tp], "median_ttft_ms": by_t[t_ttft]["median_ttft_ms"]}
    payload["in_process_output_throughput"] = ip["output_throughput"]
    payload["http_over_in_process"] = conc["output_throughput"] / ip["output_throughput"]
    payload["in_process_median_ttft_ms"] = ip["median_ttft_ms"]
    payload["c1_ttft_overhead_ms"] = c1["median_ttft_ms"] - ip["median_ttft_ms"]
    payload["greedy_text_matches"] = sum(a == b for a, b in zip(http_texts, ip["texts"]))
    payload["in_process_threads"] = {"throughput": t_tp, "ttft": t_ttft}
    payload["in_process_by_threads"] = {
        str(t): {k: r[k] for k in ("output_throughput", "median_ttft_ms")}
        for t, r in by_t.items()}
    return ip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.engine_threads = args.engine_threads or default_engine_threads()
    payload = run(args)
    print_report(payload)
    write_json(args.json, payload)
    if args.json:
        try:
            write_chart(payload, Path(args.json).with_suffix(".html"))
        except ImportError:
            print("plotly is not installed (pip install labkit[lab]); chart skipped")
    return 0


def _parser() -> argparse.ArgumentParser:
    """``labkit bench serve``'s flags beside the common bench ones."""
    p = bench_parser("serve", __doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible server (default: "
                   "start labkit serve)")
    p.add_argument("--model", default="labkit-tiny", help="model name sent in requests")
    p.add_argument("--model-path", default="labkit-tiny", help="what the own server and "
                   "the in-process run load")
    p.add_argument("--dataset", default="code_prompts", help="a prompt set in "
                   "datasets/workloads/")
    p.add_argument("--rates", default=None, help="comma list of req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--no-fairness", dest="fairness", action="store_false")
    p.add_argument("--in-process", action="store_true", help="with --base-url: also run "
                   "--model-path in process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-modes", default=ENGINE_MODES, help="own servers: engine loop in "
                   "a 'thread' of the server and/or its own 'process' (vLLM's EngineCore), "
                   "measured one after the other in this run; the first is the headline")
    p.add_argument("--engine-threads", default=None, help="own servers and the "
                   "in-process baseline: torch threads to try (comma list; default: torch's "
                   "count, then 1); the baseline keeps its best, each setting is reported")
    return p
