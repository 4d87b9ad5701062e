"""``labkit bench moe``: the experts' implementations, MoE vs dense, and expert parallelism.

Why: an MoE layer stores E experts but a token pays for k of them, and where the experts live
decides what moves between devices. Three questions, each answered on a seeded tiny Qwen3-MoE
checkpoint (8 experts, top-2; and on ``labkit-tiny-moe`` when that folder exists):

1. **Experts, three ways.** The engine's reference (``model/moe.py``'s
   ``fused_experts_loop``: pairs sorted by expert, one gather / SwiGLU / scatter-add per
   expert) against ``kernels/fused_moe.py``'s ``fused_moe_ref`` (transformers' naive loop:
   ``torch.where`` per expert) on one layer's real weights, CPU time, decode (1 token) and
   prefill shapes. The Triton ``fused_moe`` cannot be timed on CPU (the interpreter runs it in
   Python), so there it is a correctness check only: the layer's output against the loop, and
   greedy generation with the kernel in the engine. Its speed is a GPU question.
2. **MoE vs dense at equal active parameters.** A dense Llama with the same attention,
   embeddings and depth, its MLP width chosen so that its parameter count equals the MoE's
   *active* count (``ModelConfig.num_parameters(active=True)``); tokens/s of both through the
   engine (CPU time). What the MoE pays for its E-times-larger storage at equal compute.
3. **EP=2 vs EP=1.** The MoE through two worker processes with ``enable_expert_parallel``
   against one worker process (``distributed_executor_backend="mp"``: the same code, no
   peer): wall time per step, and the all-to-all bytes per step, checked against
   ``MoE layers x tokens x top-k x hidden x 4`` in each direction (``ep_bytes_match_formula``).
   On one CPU machine the two ranks share the cores and gloo copies through loopback, so EP
   here shows the *bytes*; its time is an upper bound of the overhead, not a speed-up.

``outputs_match``: greedy tokens of the loop engine, the fused-kernel engine and the EP=2 and
EP=1 engines all equal transformers' ``generate`` on the same checkpoint.
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

import torch
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, compare, environment, print_table, write_results
from labkit.sim.expert import all_to_all_bytes

QUICK = {"prompts": 4, "prompt_len": 12, "max_tokens": 8, "prefill_tokens": 64,
         "max_seconds": 4.0}
FULL = {"prompts": 8, "prompt_len": 48, "max_tokens": 32, "prefill_tokens": 256,
        "max_seconds": 20.0}
SHIPPED = "labkit-tiny-moe"


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length - i,), generator=g).tolist() for i in range(n)]


def reference_tokens(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (the independent reference)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                            max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from labkit import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=sp)]


def experts_section(model: Any, prefill: int, max_seconds: float) -> list[dict[str, Any]]:
    """Loop vs ``fused_moe_ref`` on the first MoE layer's weights and the router's real
    choices for random hidden states, at 1 token and ``prefill`` tokens."""
    from labkit.kernels.fused_moe import fused_moe_ref
    from labkit.model.moe import fused_experts_loop, moe_blocks

    block = moe_blocks(model)[0]
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    rows = []
    for tokens in (1, prefill):
        x = torch.randn(tokens, model.config.hidden_size,
                        generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            _, w, ids = block.route(x)
        args = (x, w13, w2, w, ids)

        def variant(fn: Any, args: tuple = args) -> Any:
            return lambda: (lambda: fn(*args))

        c = compare({"fused_moe_ref": variant(fused_moe_ref), "loop": variant(fused_experts_loop)},
                    baseline="fused_moe_ref", max_seconds=max_seconds)
        same = torch.allclose(fused_experts_loop(*args), fused_moe_ref(*args), rtol=1e-5,
                              atol=1e-6)
        rows.append({"tokens": tokens, "ref_over_loop": c.speedup("loop"),
                     "trusted": c.trusted, "loop_equals_ref": same,
                     "loop_ms": 1e3 * min(t.cpu_s for t in c.timings["loop"]),
                     "ref_ms": 1e3 * min(t.cpu_s for t in c.timings["fused_moe_ref"])})
    return rows


def kernel_check(path: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The Triton ``fused_moe`` (on a GPU, or under TRITON_INTERPRET=1): one layer's output
    against the loop, and greedy tokens with the kernel running every MoE layer."""
    from labkit import LLM
    from labkit.kernels.fused_moe import fused_moe
    from labkit.model.moe import fused_experts_loop, moe_blocks, use_fused_experts

    llm = LLM(model=path, dtype=torch.float32, device="cpu")
    block = moe_blocks(llm.model)[0]
    x = torch.randn(9, llm.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, w, ids = block.route(x)
        e = block.experts
        a = fused_moe(x, e.gate_up_proj, e.down_proj, w, ids)
        b = fused_experts_loop(x, e.gate_up_proj, e.down_proj, w, ids)
    use_fused_experts(llm.model, fused_moe)  # the engine's Triton path, torch attention
    return {"layer_max_abs_diff": float((a - b).abs().max()),
            "layer_close": bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5)),
            "tokens": _greedy(llm, prompts, max_tokens)}


def run_kernel_check(path: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """In this process when Triton can run here (a GPU, or the interpreter already on), else
    in a child process with TRITON_INTERPRET=1 (it must be set before Triton is imported)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return {**kernel_check(str(path), prompts, max_tokens),
                "mode": "gpu" if torch.cuda.is_available() else "interpreter"}
    code = ("import json, sys; from labkit.bench.moe import kernel_check; "
            "a = json.loads(sys.argv[1]); print(json.dumps(kernel_check(*a)))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps([str(path), prompts,
                                                                    max_tokens])],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(f"the interpreter check failed:\n{out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "mode": "interpreter"}


def dense_twin(config: Any) -> Any:
    """The MoE's config with every MLP dense (same attention, embeddings and depth), its width
    chosen so that its parameter count is the MoE's *active* count (to within one channel per
    layer)."""
    import dataclasses

    probe = dataclasses.replace(config, num_experts=0, num_experts_per_tok=0,
                                shared_expert_intermediate_size=0, intermediate_size=1)
    per_channel = 3 * config.hidden_size * config.num_hidden_layers
    width = round((config.num_parameters(active=True) - probe.num_parameters()) / per_channel)
    return dataclasses.replace(probe, intermediate_size=width + 1)


def throughput_section(model: Any, prompts: list[list[int]], max_tokens: int,
                       max_seconds: float) -> dict[str, Any]:
    """Tokens/s (CPU time) of the MoE and of its dense twin through the engine."""
    from labkit import LLM
    from labkit.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(dense_twin(model.config)).eval()
    engines = {"moe": LLM((model, None)), "dense": LLM((dense, None))}
    new = len(prompts) * max_tokens

    def variant(name: str) -> Any:
        return lambda: (lambda: _greedy(engines[name], prompts, max_tokens))

    c = compare({n: variant(n) for n in engines}, baseline="dense", max_seconds=max_seconds)
    cpu = {n: min(t.cpu_s for t in c.timings[n]) for n in engines}
    return {"moe_active_params": model.config.num_parameters(active=True),
            "moe_total_params": model.config.num_parameters(),
            "dense_params": dense.config.num_parameters(),
            "dense_intermediate_size": dense.config.intermediate_size,
            "moe_tokens_per_s": new / cpu["moe"], "dense_tokens_per_s": new / cpu["dense"],
            "moe_over_dense_speed": c.speedup("moe"), "trusted": c.trusted}


def ep_run(path: Path, world: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens, wall time per step and all-to-all bytes per step with ``world`` ranks."""
    from labkit import LLM

    mp = {"distributed_executor_backend": "mp"} if world == 1 else {}
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", tensor_parallel_size=world,
              enable_expert_parallel=True, **mp)
    try:
        _greedy(llm, prompts[:1], 2)  # warm-up: first-call costs out of the timing
        llm.llm_engine.trace.steps.clear()
        t0 = time.perf_counter()
        tokens = _greedy(llm, prompts, max_tokens)
        wall = time.perf_counter() - t0
        steps = [s for s in llm.llm_engine.trace.steps if s["scheduled"]]
    finally:
        llm.shutdown()
    c = llm.model.config
    # the simulator's formula (labkit.sim.expert), every MoE layer, float32 activations
    want = [len(c.moe_layers) * all_to_all_bytes(s["num_batched_tokens"], c.num_experts_per_tok,
                                                 c.hidden_size, 4) for s in steps]
    match = all(s["collectives"][kind]["bytes"] == w for s, w in zip(steps, want)
                for kind in ("all_to_all_dispatch", "all_to_all_combine"))
    n = max(len(steps), 1)
    col = [s["collectives"] for s in steps]
    return {"ep": world, "steps": len(steps), "step_ms": 1e3 * wall / n,
            "dispatch_bytes_per_step": sum(x["all_to_all_dispatch"]["bytes"] for x in col) / n,
            "remote_bytes_per_step": sum(x["all_to_all_dispatch"]["remote_bytes"]
                                         for x in col) / n,
            "combine_bytes_per_step": sum(x["all_to_all_combine"]["bytes"] for x in col) / n,
            "tokens_per_step": sum(s["num_batched_tokens"] for s in steps) / n,
            "bytes_match_formula": match, "tokens": tokens}


def bench_checkpoint(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every section on one checkpoint folder."""
    from labkit import LLM
    from labkit.model.loader import load_pretrained

    model, _ = load_pretrained(path, skip_tokenizer_init=True)
    c = model.config
    prompts = _prompts(cfg["prompts"], cfg["prompt_len"], c.vocab_size)
    ref = reference_tokens(path, prompts, cfg["max_tokens"])
    steps = tqdm(total=5, desc=f"moe {path.name}", leave=False)
    experts = experts_section(model, cfg["prefill_tokens"], cfg["max_seconds"])
    steps.update()
    kernel = run_kernel_check(path, prompts, cfg["max_tokens"])
    steps.update()
    tput = throughput_section(model, prompts, cfg["max_tokens"], cfg["max_seconds"])
    loop_tokens = _greedy(LLM((model, None)), prompts, cfg["max_tokens"])
    steps.update()
    ep = [ep_run(path, w, prompts, cfg["max_tokens"]) for w in (1, 2)]
    steps.update(2)
    steps.close()
    outputs = {"loop": loop_tokens, "fused": kernel.pop("tokens"),
               **{f"ep{r['ep']}": r.pop("tokens") for r in ep}}
    return {"checkpoint": path.name, "architecture": c.architecture,
            "num_experts": c.num_experts, "top_k": c.num_experts_per_tok,
            "outputs_equal_reference": {k: v == ref for k, v in outputs.items()},
            "experts": experts, "kernel": kernel, "throughput": tput, "ep": ep}


def run(quick: bool = True, shipped: Path | None = None) -> dict[str, Any]:
    """The tiny Qwen3-MoE (written here by transformers), then ``shipped`` if given."""
    from labkit.model.testing import tiny_moe_checkpoint

    cfg = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="labkit-bench-moe-") as tmp:
        _, path = tiny_moe_checkpoint(Path(tmp) / "tiny-qwen3-moe", "qwen3_moe", seed=0)
        results = [bench_checkpoint(path, cfg)]
    if shipped is not None:
        results.append(bench_checkpoint(shipped, cfg))
    return {"benchmark": "moe", "quick": quick, "sizes": cfg, "results": results,
            "outputs_match": all(all(r["outputs_equal_reference"].values())
                                 and r["kernel"]["layer_close"]
                                 and all(e["loop_equals_ref"] for e in r["experts"])
                                 for r in results),
            "ep_bytes_match_formula": all(e["bytes_match_formula"] for r in results
                                          for e in r["ep"]),
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "experts: CPU ms per call", "MoE vs dense (equal active params): tokens/s",
        "EP: all-to-all bytes per step (dispatch)"))
    for r in payload["results"]:
        name = r["checkpoint"]
        for kind in ("loop", "ref"):
            fig.add_bar(x=[f"{name} T={e['tokens']}" for e in r["experts"]],
                        y=[e[f"{kind}_ms"] for e in r["experts"]], name=kind, row=1, col=1)
        t = r["throughput"]
        fig.add_bar(x=[f"{name} moe", f"{name} dense"],
                    y=[t["moe_tokens_per_s"], t["dense_tokens_per_s"]], row=1, col=2,
                    showlegend=False)
        fig.add_bar(x=[f"{name} EP={e['ep']}" for e in r["ep"]],
                    y=[e["dispatch_bytes_per_step"] for e in r["ep"]], name="payload",
                    row=1, col=3)
        fig.add_bar(x=[f"{name} EP={e['ep']}" for e in r["ep"]],
                    y=[e["remote_bytes_per_step"] for e in r["ep"]], name="to another rank",
                    row=1, col=3)
    fig.update_layout(title="Mixture of experts on CPU", barmode="group")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("moe", __doc__.splitlines()[0])
    p.add_argument("--shipped", default=None, metavar="FOLDER",
                   help=f"also bench this MoE folder (default: {SHIPPED} when it exists)")
    args = p.parse_args(argv)
    from labkit.model.loader import models_dir

    shipped = Path(args.shipped) if args.shipped else models_dir() / SHIPPED
    payload = run(args.quick, shipped if (shipped / "config.json").is_file() else None)
    for r in payload["results"]:
        print(f"\n{r['checkpoint']} ({r['architecture']}, top-{r['top_k']} of "
              f"{r['num_experts']}): greedy = transformers: {r['outputs_equal_reference']}")
        print_table(r["experts"])
        print(f"fused_moe ({r['kernel']['mode']}): layer max |diff| "
              f"{r['kernel']['layer_max_abs_diff']:.2e}")
        print_table([r["throughput"]])
        print_table(r["ep"])
    print(f"\noutputs_match: {payload['outputs_match']}, ep_bytes_match_formula: "
          f"{payload['ep_bytes_match_formula']}")
    write_results(args.json, payload, write_chart)
    return 0 if payload["outputs_match"] and payload["ep_bytes_match_formula"] else 1


if __name__ == "__main__":
    sys.exit(main())
