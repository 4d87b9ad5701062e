"""``labkit bench memory``: how much reserved KV memory holds real token state, paged vs not.

Why: before paging, serving systems reserved a contiguous KV slot per request for the longest
sequence it might reach (prompt + max output, often the model's whole context), because they could
not know the output length. A chat request uses a few hundred of those 2,048 slots, so most of the
memory — which bounds the batch size and therefore throughput — held nothing (the vLLM paper,
Fig. 2, measured only 20-38% of KV memory holding token state). Paging allocates fixed-size
blocks on demand, so only each sequence's last block is partly empty.

Utilization = token slots holding state / slots reserved, weighted by step duration over the run
(equivalently token-state bytes / reserved bytes). The contiguous baseline is the same engine
with ``block_size`` = the maximum sequence length: one block per sequence, reserved whole on
admission — exactly max-length pre-allocation, with the scheduler and workload unchanged. A
second contiguous figure re-prices the *paged* run's own schedule at max-length reservations, so
the comparison does not depend on the smaller batch the contiguous pool admits.

Two settings: Llama-2-7B on an A100-80GB in the simulator (the chat workload: ShareGPT-like
lengths, 161/338 mean), and the real tiny model on CPU through ``labkit.LLM`` (chat-shaped lengths
clipped to its context).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import (
    bench_parser,
    environment,
    greedy_params,
    print_table,
    write_results,
)
from labkit.engine.metrics import compute_metrics, kv_summary, kv_usage

QUICK = {"sim_requests": 300, "real_requests": 8, "real_max_prompt": 192, "real_max_output": 192}
FULL = {"sim_requests": 1000, "real_requests": 32, "real_max_prompt": 512, "real_max_output": 512}


def same_schedule_contiguous(trace: Any, max_len: int) -> float | None:
    """Utilization if every sequence running in ``trace`` had reserved ``max_len`` slots."""
    d = trace if isinstance(trace, dict) else trace.to_dict()
    num, den = 0.0, 0.0
    for rec in d["steps"]:
        running = rec["queues"]["running"]
        if running and rec["kv"]["token_slots_used"]:
            w = rec.get("duration", 0.0) or 1.0
            num += w * rec["kv"]["token_slots_used"]
            den += w * running * max_len
    return num / den if den else None


def usage_series(trace: Any, points: int = 120) -> dict[str, list[float]]:
    """KV slots reserved vs holding token state over time, thinned to about ``points`` rows."""
    rows = kv_usage(trace)
    bs = (trace if isinstance(trace, dict) else trace.to_dict())["meta"]["block_size"]
    rows = rows[:: max(1, len(rows) // points)]
    return {"time": [r["time"] for r in rows], "reserved": [r["used"] * bs for r in rows],
            "tokens": [r["token_slots_used"] for r in rows]}


def _summary(trace: Any, metrics: dict[str, Any], label: str) -> dict[str, Any]:
    d = trace if isinstance(trace, dict) else trace.to_dict()
    kv = kv_summary(d)
    return {"allocator": label, "block_size": d["meta"]["block_size"],
            "utilization": kv["mean_slot_utilization"], "mean_block_usage": kv["mean_usage"],
            "peak_running": max((r["queues"]["running"] for r in d["steps"]), default=0),
            "tokens_per_s": metrics["tokens_per_s"], "preemptions":
                sum(len(r.get("preempted", ())) for r in d["steps"])}


def run_sim(num_requests: int, model: str = "llama-2-7b", gpu: str = "a100-80gb",
            block_size: int = 16, max_len: int = 2048, seed: int = 0) -> dict[str, Any]:
    """Paged (``block_size``) vs max-length pre-allocation (one ``max_len`` block) in the sim."""
    from labkit.sim.simulate import simulate

    rows, series = [], {}
    for label, bs in tqdm([("paged", block_size), ("contiguous", max_len)], desc="sim",
                          leave=False):
        res = simulate(model=model, gpu=gpu, workload="chat", num_requests=num_requests,
                       block_size=bs, enable_prefix_caching=False, seed=seed)
        rows.append(_summary(res.trace, res.metrics, label))
        series[label] = usage_series(res.trace)
        if label == "paged":
            same = same_schedule_contiguous(res.trace, max_len)
    return {"model": model, "gpu": gpu, "workload": "chat", "num_requests": num_requests,
            "max_len": max_len, "rows": rows, "contiguous_same_schedule": same,
            "series": series}


def run_real(model: str | Path, num_requests: int, max_prompt: int, max_output: int,
             block_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """The same comparison on the real model: synthetic prompts with chat-shaped lengths."""
    from labkit import LLM
    from labkit.model.loader import load_config, resolve_model_path
    from labkit.sim.workloads import get_workload

    path = resolve_model_path(model)
    cfg = load_config(path)
    max_len = cfg.max_position_embeddings
    max_prompt = min(max_prompt, max_len // 2)
    max_output = min(max_output, max_len - max_prompt)
    specs = get_workload("chat", max_prompt_len=max_prompt,
                         max_output_len=max_output).sample(num_requests, seed=seed)
    prompts = [s.prompt_token_ids(vocab_size=cfg.vocab_size, first_id=1) for s in specs]
    params = [greedy_params(s.output_len) for s in specs]
    # One KV budget for both: every request's maximum fits at once in the contiguous layout.
    num_slots = num_requests * max_len
    rows = []
    for label, bs in tqdm([("paged", block_size), ("contiguous", max_len)], desc="real",
                          leave=False):
        llm = LLM(model=str(path), block_size=bs, num_blocks=num_slots // bs,
                  enable_prefix_caching=False, max_num_seqs=num_requests, dtype="float32")
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        engine = llm.llm_engine
        rows.append(_summary(engine.trace, compute_metrics(engine.request_timings()), label))
        if label == "paged":
            same = same_schedule_contiguous(engine.trace, max_len)
    return {"model": str(model), "num_requests": num_requests, "max_len": max_len,
            "prompt_len_mean": float(np.mean([s.prompt_len for s in specs])),
            "output_len_mean": float(np.mean([s.output_len for s in specs])),
            "rows": rows, "contiguous_same_schedule": same}


def run(model: str | Path = "labkit-tiny", quick: bool = True, seed: int = 0,
        sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    sim = run_sim(cfg["sim_requests"], seed=seed)
    real = run_real(model, cfg["real_requests"], cfg["real_max_prompt"], cfg["real_max_output"],
                    seed=seed)
    util = {r["allocator"]: r["utilization"] for r in sim["rows"]}
    return {"benchmark": "memory", "quick": quick,
            "paged_utilization": util["paged"], "contiguous_utilization": util["contiguous"],
            "sim": sim, "real": real, "environment": environment()}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    sim = payload["sim"]
    fig = make_subplots(rows=1, cols=3, column_widths=[0.25, 0.375, 0.375], subplot_titles=(
        "utilization", f"paged (block {sim['rows'][0]['block_size']}), simulated",
        f"contiguous ({sim['max_len']} slots per sequence), simulated"))
    names = {"sim": f"{sim['model']} on {sim['gpu']} (simulated)",
             "real": f"{payload['real']['model']} (CPU)"}
    for setting, name in names.items():
        rows = payload[setting]["rows"]
        fig.add_bar(x=[r["allocator"] for r in rows], y=[r["utilization"] for r in rows],
                    name=name, row=1, col=1)
    for col, label in ((2, "paged"), (3, "contiguous")):
        s = sim["series"][label]
        fig.add_scatter(x=s["time"], y=s["reserved"], name=f"{label}: reserved slots",
                        fill="tozeroy", row=1, col=col)
        fig.add_scatter(x=s["time"], y=s["tokens"], name=f"{label}: slots holding tokens",
                        fill="tozeroy", row=1, col=col)
    fig.update_xaxes(title_text="simulated time (s)", row=1, col=2)
    fig.update_xaxes(title_text="simulated time (s)", row=1, col=3)
    fig.update_layout(title="KV memory holding token state: paged blocks vs max-length slots",
                      barmode="group", yaxis_range=[0, 1])
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("memory", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny", help="shipped model name or folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    payload = run(args.model, quick=args.quick, seed=args.seed)
    sim, real = payload["sim"], payload["real"]
    print(f"\nsimulated {sim['model']} on {sim['gpu']}, chat workload, {sim['num_requests']} "
          f"requests; contiguous reserves {sim['max_len']} slots per sequence")
    print_table(sim["rows"])
    print(f"paged schedule re-priced at {sim['max_len']}-slot reservations: "
          f"{sim['contiguous_same_schedule']:.3f}")
    print(f"\n{real['model']} on CPU, {real['num_requests']} requests, prompt/output mean "
          f"{real['prompt_len_mean']:.0f}/{real['output_len_mean']:.0f}, contiguous reserves "
          f"{real['max_len']}")
    print_table(real["rows"])
    print(f"\npaged_utilization = {payload['paged_utilization']:.3f}   "
          f"contiguous_utilization = {payload['contiguous_utilization']:.3f}")
    write_results(args.json, payload, write_chart)
    return 0
