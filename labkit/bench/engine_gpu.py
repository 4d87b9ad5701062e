"""``labkit bench engine-gpu``: the engine's headline claims with a real model's shapes, each
beside the simulator's prediction for the same requests (issue 18, item 4).

Every other engine benchmark runs labkit-tiny (5 M parameters) on a CPU, where a step is Python
overhead, and the "2-10x" of continuous batching is only simulated for 7-8 B models on an A100.
This one builds a random-weight model with a published shape (``--shape llama-3.2-1b``: 1.2 B
parameters, GQA 32/8, bf16; random weights because nothing may be downloaded, and a step's cost
depends on the shapes, not the values), and measures through ``labkit.LLM``:

1. **continuous vs static batching** on ShareGPT-shaped lengths (``sharegpt`` workload: the
   lognormal prompt and output lengths of real chat traffic), output tokens/s of each;
2. **prefix caching**: the time to first token of requests that share a long system prompt,
   one at a time after the prompt was served once, cache off vs on;
3. **labkit vs transformers** ``generate`` (left-padded static batches) at each batch size;

and runs the same requests through ``labkit.sim`` on ``--gpu`` (the roofline cost model), so
the report states the simulator's error beside each measurement. On a CPU the same code runs
with ``--shape tiny`` (what the test does); its numbers then say nothing about a GPU.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from labkit.bench.batching import run_hf
from labkit.bench.common import bench_parser, environment, greedy_params, write_json
from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.sim.presets import ModelPreset, get_model_preset
from labkit.sim.workloads import RequestSpec, get_workload
from labkit.train.export import save_weights

# a CPU-sized shape for the test; every other name is a labkit.sim model preset
TINY = ModelPreset("tiny", 2, 64, 4, 2, 16, 128, 512, dtype_bytes=4,
                   max_position_embeddings=4096)
BLOCK_SIZE = 16
BATCHED_TOKENS = 2048  # per step, labkit and simulator alike (chunked prefill beyond it)
QUICK = {"num_requests": 64, "batch_sizes": (16, 64), "max_prompt_len": 512,
         "max_output_len": 256, "prefix_len": 1024, "suffix_len": 64, "prefix_requests": 8}


def model_config(p: ModelPreset) -> ModelConfig:
    """labkit's (Hugging Face's) config for a simulator preset: the same shape, two views."""
    return ModelConfig(vocab_size=p.vocab_size, hidden_size=p.hidden_size,
                       intermediate_size=p.intermediate_size, num_hidden_layers=p.num_layers,
                       num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
                       head_dim=p.head_dim, max_position_embeddings=p.max_position_embeddings,
                       attention_bias=p.attention_bias,
                       tie_word_embeddings=p.tie_word_embeddings,
                       # the presets with q/k/v biases are Qwen2's (no o_proj bias)
                       architecture="Qwen2ForCausalLM" if p.attention_bias
                       else "LlamaForCausalLM")


def random_model(p: ModelPreset, dtype: torch.dtype, device: str, seed: int = 0
                 ) -> LlamaForCausalLM:
    """Seeded random weights, built on ``device`` directly (a 1 B model initialised on the CPU
    first would take longer than the benchmark)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(model_config(p))
    return model.to(dtype).eval()


def chat_requests(p: ModelPreset, n: int, max_prompt: int, max_output: int, seed: int
                  ) -> list[RequestSpec]:
    """ShareGPT-shaped prompt and output lengths, clipped to fit; all arrive at t = 0."""
    wl = get_workload("sharegpt", max_prompt_len=max_prompt, max_output_len=max_output)
    return wl.sample(n, seed, None)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate(llm: Any, prompts: list[list[int]], max_tokens: list[int], device: str
              ) -> tuple[list[list[int]], float]:
    params = [greedy_params(m) for m in max_tokens]
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    _sync(device)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def batching(model: Any, p: ModelPreset, specs: list[RequestSpec], batch_size: int, gpu: str,
             device: str, backend: str = "torch") -> dict[str, Any]:
    """Continuous vs static through labkit.LLM, and the simulator's tokens/s for both."""
    from labkit import LLM
    from labkit.sim.simulate import simulate

    prompts = [s.prompt_token_ids(p.vocab_size) for s in specs]
    max_tokens = [s.output_len for s in specs]
    row: dict[str, Any] = {"batch_size": batch_size, "num_requests": len(specs),
                           "output_tokens": sum(max_tokens)}
    # the same limits on both sides: a pool that never preempts, one token budget per step
    max_len = max(len(q) for q in prompts) + max(max_tokens) + 1
    limits = {"max_num_seqs": batch_size, "max_num_batched_tokens": BATCHED_TOKENS,
              "enable_prefix_caching": False, "batching": None}
    num_blocks = -(-batch_size * max_len // BLOCK_SIZE)
    outs = {}
    for mode in ("continuous", "static"):
        limits["batching"] = mode
        llm = LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_len,
                  attention_backend=backend, **limits)
        # warm-up at the batch's own shapes: Triton compiles per specialisation, and the
        # caching allocator grows to its high-water mark, outside the timed pass
        _generate(llm, prompts[:batch_size], [8] * min(batch_size, len(prompts)), device)
        outs[mode], wall = _generate(llm, prompts, max_tokens, device)
        row[f"{mode}_tokens_per_s"] = sum(max_tokens) / wall
        row[f"{mode}_preemptions"] = llm.llm_engine.stats().get("num_preemptions", 0)
        sim = simulate(model=p, gpu=gpu, workload=specs, record_trace=False,
                       block_size=BLOCK_SIZE,
                       kv_cache_bytes=num_blocks * BLOCK_SIZE * p.kv_bytes_per_token, **limits)
        row[f"sim_{mode}_tokens_per_s"] = sim.metrics["tokens_per_s"]
        row[f"sim_error_{mode}"] = sim.metrics["tokens_per_s"] / row[f"{mode}_tokens_per_s"]
        del llm
    row["speedup"] = row["continuous_tokens_per_s"] / row["static_tokens_per_s"]
    row["sim_speedup"] = row["sim_continuous_tokens_per_s"] / row["sim_static_tokens_per_s"]
    row["same_tokens"] = sum(a == b for a, b in zip(outs["continuous"], outs["static"]))
    row["_outputs"] = outs["continuous"]
    return row


def prefix_ttft(model: Any, p: ModelPreset, cfg: dict[str, Any], gpu: str, device: str,
                backend: str = "torch") -> dict[str, Any]:
    """TTFT of requests sharing a ``prefix_len``-token system prompt, one at a time, after that
    prompt was served once (as a server would have); cache off vs on, measured and simulated."""
    from labkit import LLM
    from labkit.sim.simulate import simulate

    wl = get_workload("shared-prefix", num_groups=1, prefix_len=cfg["prefix_len"],
                      suffix_min=cfg["suffix_len"], suffix_max=cfg["suffix_len"],
                      output_min=1, output_max=1)
    specs = wl.sample(cfg["prefix_requests"] + 1, 0, 0.5)  # 2 s apart: no queueing
    prompts = [s.prompt_token_ids(p.vocab_size) for s in specs]
    out: dict[str, Any] = {"prefix_len": cfg["prefix_len"], "suffix_len": cfg["suffix_len"]}
    for cache in (False, True):
        llm = LLM(model, enable_prefix_caching=cache, max_model_len=len(prompts[0]) + 2,
                  max_num_batched_tokens=BATCHED_TOKENS, attention_backend=backend)
        eng = llm.llm_engine
        _generate(llm, prompts[:1], [1], device)  # serves the system prompt once
        ttfts = []
        for q in prompts[1:]:
            _sync(device)
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=[q], sampling_params=greedy_params(1), use_tqdm=False)
            _sync(device)
            ttfts.append(time.perf_counter() - t0)
        key = "on" if cache else "off"
        out[f"ttft_ms_cache_{key}"] = float(np.median(ttfts)) * 1e3
        out[f"hit_rate_cache_{key}"] = eng.stats().get("prefix_hit_rate", 0.0)
        sim = simulate(model=p, gpu=gpu, workload=specs, enable_prefix_caching=cache,
                       max_num_batched_tokens=BATCHED_TOKENS, record_trace=False)
        t = [r["first_token_time"] - r["arrival_time"] for r in sim.timings
             if r["request_id"] != "r0"]  # r0 served the system prompt
        out[f"sim_ttft_ms_cache_{key}"] = float(np.median(t)) * 1e3
        del llm
    out["speedup"] = out["ttft_ms_cache_off"] / out["ttft_ms_cache_on"]
    out["sim_speedup"] = out["sim_ttft_ms_cache_off"] / out["sim_ttft_ms_cache_on"]
    return out


def run(shape: str = "llama-3.2-1b", gpu: str = "h200", device: str | None = None,
        dtype: str = "bfloat16", cfg: dict[str, Any] | None = None, hf: bool = True,
        seed: int = 0, backend: str | None = None) -> dict[str, Any]:
    """Everything above for one shape; ``backend``: labkit's attention backend (default:
    the Triton kernels on a GPU, the PyTorch reference on a CPU)."""
    cfg = {**QUICK, **(cfg or {})}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("triton" if device.startswith("cuda") else "torch")
    p = TINY if shape == "tiny" else get_model_preset(shape)
    tdtype = getattr(torch, dtype)
    model = random_model(p, tdtype, device, seed)
    specs = chat_requests(p, cfg["num_requests"], cfg["max_prompt_len"], cfg["max_output_len"],
                          seed)
    payload: dict[str, Any] = {"shape": p.name, "gpu_preset": gpu, "device": device,
                               "attention_backend": backend,
                               "dtype": dtype, "num_parameters": model.config.num_parameters(),
                               "config": {k: list(v) if isinstance(v, tuple) else v
                                          for k, v in cfg.items()},
                               "batching": [], "environment": environment()}
    if device.startswith("cuda"):
        payload["device_name"] = torch.cuda.get_device_name()
    bar = tqdm(total=len(cfg["batch_sizes"]) * (2 if hf else 1) + 1, desc="bench engine-gpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = save_weights(model, model.config, tmp, tdtype) if hf else None
        for b in cfg["batch_sizes"]:
            row = batching(model, p, specs, b, gpu, device, backend)
            bar.update(1)
            outs = row.pop("_outputs")
            if path is not None:
                r = run_hf(path, [s.prompt_token_ids(p.vocab_size) for s in specs],
                           [s.output_len for s in specs], b, dtype=tdtype, device=device)
                row["hf_tokens_per_s"] = r["tokens_per_s"]
                row["labkit_over_hf"] = row["continuous_tokens_per_s"] / r["tokens_per_s"]
                row["same_tokens_as_hf"] = sum(a == b_ for a, b_ in zip(outs, r["outputs"]))
                bar.update(1)
            payload["batching"].append(row)
    payload["prefix"] = prefix_ttft(model, p, cfg, gpu, device, backend)
    bar.update(1)
    bar.close()
    return payload


def report_md(payload: dict[str, Any]) -> str:
    """The markdown report: every measurement beside the simulator's number and their ratio."""
    lines = [f"# labkit bench engine-gpu: {payload['shape']} ({payload['dtype']}, random "
             f"weights) on {payload.get('device_name', payload['device'])}, "
             f"{payload['attention_backend']} attention", "",
             f"Simulator preset: `{payload['gpu_preset']}`. sim/measured > 1: the simulator "
             "is optimistic.", "",
             "| batch | continuous tok/s | static tok/s | speed-up | simulated speed-up | "
             "sim/measured (continuous) | labkit / transformers |", "|---|---|---|---|---|---|---|"]
    for r in payload["batching"]:
        hf = f"{r['labkit_over_hf']:.2f}×" if "labkit_over_hf" in r else "not run"
        lines.append(f"| {r['batch_size']} | {r['continuous_tokens_per_s']:.0f} | "
                     f"{r['static_tokens_per_s']:.0f} | **{r['speedup']:.2f}×** | "
                     f"{r['sim_speedup']:.2f}× | {r['sim_error_continuous']:.2f} | {hf} |")
    f = payload["prefix"]
    lines += ["", f"Prefix caching ({f['prefix_len']}-token system prompt + {f['suffix_len']} "
              f"own tokens, one request at a time): TTFT {f['ttft_ms_cache_off']:.1f} ms off, "
              f"{f['ttft_ms_cache_on']:.1f} ms on: **{f['speedup']:.2f}×** (simulated "
              f"{f['sim_ttft_ms_cache_off']:.1f} / {f['sim_ttft_ms_cache_on']:.1f} ms: "
              f"{f['sim_speedup']:.2f}×).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("engine-gpu", __doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a labkit.sim model preset, or "
                    "'tiny' (a CPU-sized shape for checking the code path)")
    ap.add_argument("--gpu", default="h200", help="the simulator's GPU preset to compare with")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--batch-sizes", default=None, help="comma list (default 16,64)")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"],
                    help="default: triton on a GPU, torch on a CPU")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    args = ap.parse_args(argv)
    cfg: dict[str, Any] = {}
    if args.shape != "tiny":
        try:
            get_model_preset(args.shape)
        except ValueError as e:
            ap.error(f"--shape: {e} (or 'tiny')")
    if args.num_requests is not None:
        if args.num_requests < 1:
            ap.error(f"--num-requests must be >= 1, got {args.num_requests}")
        cfg["num_requests"] = args.num_requests
    if args.batch_sizes:
        try:
            cfg["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
        except ValueError:
            cfg["batch_sizes"] = ()
        if not cfg["batch_sizes"] or min(cfg["batch_sizes"]) < 1:
            ap.error(f"--batch-sizes takes positive integers, e.g. 16,64; got {args.batch_sizes!r}")
    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device (a CPU build of torch?)")
    payload = run(args.shape, args.gpu, args.device, args.dtype, cfg, args.hf,
                  backend=args.attention_backend)
    md = report_md(payload)
    print(md)
    write_json(args.json, payload)
    if args.json:
        Path(args.json).with_suffix(".md").write_text(md + "\n")
    return 0
