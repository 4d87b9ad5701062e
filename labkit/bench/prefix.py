"""``labkit bench prefix``: time to first token with a shared system prompt, cache on vs off.

Why: chat and agent traffic repeats the same system prompt (and few-shot examples) at the start
of every request. Its KV is the same every time, so an engine that keys full KV blocks by a hash
of their tokens and everything before them can reuse those blocks instead of recomputing them:
the prefill shrinks to the request's own suffix, and TTFT with it. The saving is bounded by the
shared fraction of the prompt.

Measured on the real tiny model (CPU) with the lab's chat prompt set, whose every prompt starts
with one system prompt of most of its tokens. A warm-up request (the system prompt alone) runs
first in both settings, as a server would have seen it; then every prompt arrives at once and runs
to ``max_tokens``. TTFT per request = first token time - arrival time, from
``engine.request_timings()``; prefill tokens are summed from the trace; hit rate is the engine's
(hit tokens / queried tokens). A sequential pass (one request at a time) isolates the prefill
saving from queueing. The simulator repeats the comparison for Llama-2-7B on an A100 with a
1,024-token shared prefix under Poisson arrivals.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import (
    Comparison,
    bench_parser,
    compare,
    environment,
    greedy_params,
    print_table,
    timed,
    write_results,
)
from labkit.engine.metrics import compute_metrics
from labkit.sim.workloads import load_prompt_set

QUICK = {"num_prompts": 16, "max_tokens": 8, "sequential": 8, "sim_requests": 200}
FULL = {"num_prompts": 32, "max_tokens": 16, "sequential": 32, "sim_requests": 1000}


def _prefill_tokens(trace: dict[str, Any], request_ids: set[str]) -> int:
    return sum(s["num_tokens"] for rec in trace["steps"] for s in rec["scheduled"]
               if s["phase"] == "prefill" and s["request_id"] in request_ids)


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def run_real(model: str | Path, cache: bool, num_prompts: int, max_tokens: int,
             sequential: int) -> dict[str, Any]:
    """One engine, caching on or off: warm-up, a burst of every prompt, then a sequential pass."""
    from labkit import LLM
    from labkit.model.loader import load_pretrained, resolve_model_path

    path = resolve_model_path(model)
    _, tok = load_pretrained(path)
    prompts, system = chat_prompts(tok, num_prompts)
    sys_len = len(system)
    llm = LLM(model=str(path), enable_prefix_caching=cache, dtype="float32",
              max_num_seqs=max(num_prompts, 1))
    engine = llm.llm_engine
    params = greedy_params(max_tokens)
    engine.add_request("warmup", system, params)
    _drain(engine)

    burst = {f"burst-{i}" for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"burst-{i}", p, params)
    burst_wall = timed(_drain, engine)[1].wall_s
    for i in range(min(sequential, len(prompts))):
        rid = f"seq-{i}"
        engine.add_request(rid, prompts[-1 - i], params)
        _drain(engine)
    timings = engine.request_timings()
    trace = engine.trace.to_dict()
    burst_t = [t for t in timings if t["request_id"] in burst]
    seq_t = [t for t in timings if str(t["request_id"]).startswith("seq-")]
    seq_ttft = [t["first_token_time"] - t["arrival_time"] for t in seq_t]
    m = compute_metrics(burst_t)
    return {"cache": cache, "num_prompts": len(prompts),
            "prompt_len_mean": float(np.mean([len(p) for p in prompts])),
            "shared_prefix_len": sys_len,
            "ttft_p50": m["ttft"]["p50"], "ttft_p90": m["ttft"]["p90"],
            "ttft_mean": m["ttft"]["mean"], "burst_wall_s": burst_wall,
            "prefill_tokens": _prefill_tokens(trace, burst),
            "sequential_ttft_p50": float(np.median(seq_ttft)) if seq_ttft else None,
            "hit_rate": engine.stats().get("prefix_hit_rate", 0.0)}


def chat_prompts(tokenizer: Any, num_prompts: int) -> tuple[list[list[int]], list[int]]:
    """The lab's chat prompt set (cycled to ``num_prompts``) and its shared system prompt."""
    rows = load_prompt_set("chat_prompts")
    prompts = [tokenizer.encode(r["system"] + r["user"]) for r in rows]
    return [prompts[i % len(prompts)] for i in range(num_prompts)], tokenizer.encode(
        rows[0]["system"])


def compare_ttft(model: Any, tokenizer: Any, num_prompts: int = 3,
                 **compare_kw: Any) -> Comparison:
    """Cache off vs on as notebook 03 shows it: the time to first token of ``num_prompts`` chat
    prompts, one at a time, after the system prompt was served once (as a server would have).

    Each round builds fresh engines (untimed, with that warm-up) so a round's hits come from
    the system prompt only, never from an earlier round's identical prompt; the timed part is
    each request's prefill (``max_tokens=1``), so speed-up = TTFT off / TTFT on in CPU time.
    ``results[name]`` holds that engine's prefix hit rate."""
    from labkit import LLM

    prompts, system = chat_prompts(tokenizer, num_prompts)
    first = greedy_params(1)

    def variant(cache: bool) -> Callable[[], Callable[[], float]]:
        def prepare() -> Callable[[], float]:
            llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=cache)
            llm.generate(prompt_token_ids=[system], sampling_params=first, use_tqdm=False)

            def work() -> float:
                for p in prompts:
                    llm.generate(prompt_token_ids=[p], sampling_params=first, use_tqdm=False)
                return llm.llm_engine.stats().get("prefix_hit_rate", 0.0)
            return work
        return prepare

    return compare({"cache on": variant(True), "cache off": variant(False)},
                   baseline="cache off", **compare_kw)


def run_sim(num_requests: int, model: str = "llama-2-7b", gpu: str = "a100-80gb",
            prefix_len: int = 1024, arrival_rate: float = 8.0, seed: int = 0) -> list[dict]:
    """Simulated TTFT with one shared ``prefix_len``-token system prompt, cache on vs off."""
    from labkit.sim.simulate import simulate
    from labkit.sim.workloads import get_workload

    wl = get_workload("shared-prefix", num_groups=1, prefix_len=prefix_len, suffix_min=64,
                      suffix_max=512, output_min=32, output_max=256)
    rows = []
    for cache in (False, True):
        res = simulate(model=model, gpu=gpu, workload=wl, num_requests=num_requests,
                       arrival_rate=arrival_rate, enable_prefix_caching=cache, seed=seed)
        tr = res.trace if isinstance(res.trace, dict) else res.trace.to_dict()
        prefill = sum(s["num_tokens"] for rec in tr["steps"] for s in rec["scheduled"]
                      if s["phase"] == "prefill")
        rows.append({"cache": cache, "ttft_p50": res.metrics["ttft"]["p50"],
                     "ttft_p90": res.metrics["ttft"]["p90"], "prefill_tokens": prefill,
                     "tokens_per_s": res.metrics["tokens_per_s"]})
    return rows


def run(model: str | Path = "labkit-tiny", quick: bool = True,
        sizes: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    real = [run_real(model, cache, cfg["num_prompts"], cfg["max_tokens"], cfg["sequential"])
            for cache in tqdm((False, True), desc="prefix", leave=False)]
    off, on = real
    sim = run_sim(cfg["sim_requests"], seed=seed)
    return {
        "benchmark": "prefix", "model": str(model), "quick": quick,
        "ttft_p50_cache_off": off["ttft_p50"], "ttft_p50_cache_on": on["ttft_p50"],
        "ttft_p50_reduction": 1 - on["ttft_p50"] / off["ttft_p50"],
        "hit_rate": on["hit_rate"],
        "prefill_tokens_cache_off": off["prefill_tokens"],
        "prefill_tokens_cache_on": on["prefill_tokens"],
        "shared_prefix_fraction": off["shared_prefix_len"] / off["prompt_len_mean"],
        "real": real, "sim": sim, "environment": environment(),
    }


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"{payload['model']} on CPU: TTFT P50 (ms)", "Llama-2-7B / A100 simulated: TTFT P50 (ms)"))
    for col, rows in ((1, payload["real"]), (2, payload["sim"])):
        fig.add_bar(x=["cache off" if not r["cache"] else "cache on" for r in rows],
                    y=[1e3 * r["ttft_p50"] for r in rows], row=1, col=col, showlegend=False)
    fig.update_layout(title="Prefix caching with a shared system prompt")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("prefix", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny", help="shipped model name or folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    payload = run(args.model, quick=args.quick, seed=args.seed)
    off = payload["real"][0]
    print(f"\n{payload['model']} on CPU: {off['num_prompts']} prompts of "
          f"{off['prompt_len_mean']:.0f} tokens on average, {off['shared_prefix_len']} of them "
          "a shared system prompt "
          f"({payload['shared_prefix_fraction']:.0%})")
    print_table(payload["real"])
    print("\nsimulated Llama-2-7B on A100-80GB, 1,024-token shared prefix, Poisson arrivals")
    print_table(payload["sim"])
    print(f"\nTTFT P50: {1e3 * payload['ttft_p50_cache_off']:.1f} ms -> "
          f"{1e3 * payload['ttft_p50_cache_on']:.1f} ms "
          f"({payload['ttft_p50_reduction']:.0%} less), hit rate {payload['hit_rate']:.2f}")
    write_results(args.json, payload, write_chart)
    return 0
