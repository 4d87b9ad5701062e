"""``labkit bench spec``: decode speed with and without speculative decoding, theory beside it.

Why: a decode step of a small batch is dominated by fixed costs (reading every weight on a GPU;
Python and kernel-launch overhead on a CPU), so scoring γ+1 tokens costs about as much as
scoring one. If cheap drafts get accepted, each target step emits several tokens. The benchmark
runs the shipped ``labkit-tiny`` through ``labkit.LLM`` on the lab's code-completion prompts,
greedy, one request at a time (the latency regime speculation is for), plain and with each
proposer (n-gram prompt lookup; the ``labkit-tiny-draft`` model) for γ ∈ {1, 2, 4, 6, 8}, and
checks that every speculative output equals the plain output token for token.

Speeds are tokens per CPU-second of the benchmark process (one torch thread), which equals wall
tokens/s on an idle machine and stays meaningful on a shared one, where wall time mostly measures
the other processes; wall-clock figures are kept beside them (``wall_*``).

Beside each measurement, two predictions:

* ``predicted_speedup``: the textbook model E[tokens/step] / (γc + 1), E = (1-α^(γ+1))/(1-α), with
  the per-position α measured in the run and c = draft forward / target decode forward (0 for
  n-gram), raw forward costs on this machine;
* ``predicted_speedup_cpu``: the tokens per verify step as measured, over this machine's costs:
  a verify forward of γ+1 tokens is not free on a CPU, each engine step pays a fixed overhead O
  (scheduling, input building, sampling, trace) that speculation amortises over more tokens, and
  n-gram lookup often finds fewer than γ drafts (d per step):
  tokens_per_step · (t_decode + O) / (d · c · t_decode + t_verify(γ) + O).
  What is left between this and the measurement is engine cost the raw forwards do not see (the
  paged verify path, the draft's forwards inside the engine): ``engine_ms`` itemises it.
  Both predictions (and ``engine_ms``) model one request at a time; with ``--concurrency N`` the
  measured columns show how the gain shrinks as batching already fills each target step.

Finally the roofline cost model (``labkit.sim.cost``) predicts the same for Llama-2-7B verified on
an A100 with TinyLlama-1.1B drafting (same 32k vocabulary), at the α measured here for the tiny
draft — a stand-in: a real pair's α depends on the models and the text.
"""

from __future__ import annotations

import dataclasses
import statistics
from functools import partial
from typing import Any

import torch
from tqdm.auto import tqdm

from labkit.bench.common import (
    Comparison,
    bench_parser,
    compare,
    environment,
    greedy_params,
    timed,
    write_results,
)
from labkit.bench.spec_report import print_report, write_chart
from labkit.spec.eagle import EagleDraft, load_eagle
from labkit.spec.lean_draft import LeanEagle, lean_draft
from labkit.spec.theory import expected_speedup, expected_tokens_per_step, trace_acceptance

QUICK = {"num_prompts": 4, "max_tokens": 64, "gammas": [2, 4], "rounds": 1}
FULL = {"num_prompts": 16, "max_tokens": 128, "gammas": [1, 2, 4, 6, 8], "rounds": 2}
DEFAULT_DRAFT = "labkit-tiny-draft-distilled"
DEFAULT_EAGLE = "labkit-tiny-eagle"
# (layers, hidden, query heads, KV heads, FFN): the shipped draft's shape (2 x 128) among others
DRAFT_SHAPES = [(1, 128, 4, 2, 512), (2, 128, 4, 2, 512), (4, 64, 2, 1, 256), (1, 256, 8, 4, 704)]
SIM = {"target": "llama-2-7b", "draft": "tinyllama-1.1b", "gpu": "a100-80gb", "context": 512}


def _engine(target: torch.nn.Module, prompts: list[list[int]], spec: dict[str, Any] | None,
            concurrency: int = 1):
    """An engine for ``target`` (speculative if ``spec``), warmed up on one short request."""
    from labkit import LLM

    llm = LLM(target, max_num_seqs=concurrency, speculative_config=spec)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=greedy_params(8))
    return llm


def _counters(llm: Any) -> tuple[int, dict[str, float]]:
    eng = llm.llm_engine
    return len(eng.trace.steps), dict(getattr(eng.executor, "cpu_s", {}))


def _summary(llm: Any, outs: list[Any], before: tuple[int, dict[str, float]]) -> dict[str, Any]:
    """Tokens, acceptance and per-part CPU of the steps after ``before`` (a :func:`_counters`)."""
    eng = llm.llm_engine
    steps0, cpu_parts0 = before
    tokens = [o.outputs[0].token_ids for o in outs]
    trace = eng.trace.to_dict()
    trace["steps"] = trace["steps"][steps0:]
    verify_steps = sum(len(s["spec"]) for s in trace["steps"])
    emitted = sum(len(s["outputs"].get(r["seq_id"], [])) for s in trace["steps"]
                  for r in s["spec"])
    parts = {k: v - cpu_parts0.get(k, 0.0) for k, v in getattr(eng.executor, "cpu_s", {}).items()}
    drafted = sum(len(r["proposed"]) for s in trace["steps"] for r in s["spec"])
    return {"tokens": tokens, "num_tokens": sum(map(len, tokens)),
            "num_steps": len(trace["steps"]), "acc": trace_acceptance(trace),
            "tokens_per_step": emitted / verify_steps if verify_steps else 1.0,
            "drafts_per_step": drafted / verify_steps if verify_steps else 0.0,
            "verify_steps": verify_steps, "num_drafted": drafted, "cpu_parts_s": parts}


def run_engine(target: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
               spec: dict[str, Any] | None, concurrency: int = 1) -> dict[str, Any]:
    """Generate every prompt, ``concurrency`` at a time; wall and process CPU time.
    A warm-up request runs first."""
    llm = _engine(target, prompts, spec, concurrency)
    before = _counters(llm)
    outs, t = timed(llm.generate, prompt_token_ids=prompts,
                    sampling_params=greedy_params(max_tokens))
    return {"wall_s": t.wall_s, "cpu_s": t.cpu_s, **_summary(llm, outs, before)}


def compare_spec(target: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                 specs: dict[str, dict[str, Any]], **compare_kw: Any) -> Comparison:
    """Plain decoding against each speculative config, as notebook 05 shows it: interleaved
    rounds through :func:`labkit.bench.common.compare` (speed-up = plain CPU s / speculative
    CPU s for the same greedy tokens). ``results[name]`` is the last round's
    :func:`run_engine`-style summary (tokens, acceptance, tokens per verify step)."""

    def variant(spec: dict[str, Any] | None):
        def prepare():
            llm = _engine(target, prompts, spec)
            before = _counters(llm)

            def work():
                outs = llm.generate(prompt_token_ids=prompts,
                                    sampling_params=greedy_params(max_tokens))
                return llm, outs, before
            return work
        return prepare

    c = compare({"plain": variant(None), **{n: variant(s) for n, s in specs.items()}},
                baseline="plain", **compare_kw)
    c.results = {n: _summary(*r) for n, r in c.results.items()}
    return c


@torch.inference_mode()
def _forward_ms(model: torch.nn.Module, context: int, num_tokens: int, reps: int) -> float:
    """Median CPU ms of one forward of ``num_tokens`` new tokens after ``context`` cached ones
    (process time: on a shared machine wall time mostly measures the other processes). An
    EAGLE head gets random features beside its tokens."""
    from labkit.model.generate import ContiguousKVCache

    cache = ContiguousKVCache(model, 1, context + num_tokens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + num_tokens), generator=gen)
    kw = {}
    if isinstance(model, (EagleDraft, LeanEagle)):
        kw = {"features": torch.randn(1, context + num_tokens, model.config.hidden_size,
                                      generator=gen)}
    model(ids[:, :context], None, cache, **{k: v[:, :context] for k, v in kw.items()})
    new, pos = ids[:, context:], torch.arange(context, context + num_tokens)[None]
    kw = {k: v[:, context:] for k, v in kw.items()}
    times = []
    last = torch.tensor([num_tokens - 1])
    for _ in range(reps):
        times.append(timed(model, new, pos, cache, last, **kw)[1].cpu_s)
    return 1e3 * statistics.median(times)


def measure_costs(target, draft, gammas: list[int], context: int = 64,
                  reps: int = 30, eagle: torch.nn.Module | None = None) -> dict[str, Any]:
    """Raw model forward costs on this machine (no engine): the c and verify terms. The draft
    is timed through the forward the engine's proposer runs (the fused LeanDraft where it
    covers the model); ``draft_module_decode_ms`` keeps the plain module's cost beside it."""
    t_dec = _forward_ms(target, context, 1, reps)
    lean = lean_draft(draft)
    out = {"context": context, "target_decode_ms": t_dec,
           "draft_decode_ms": _forward_ms(lean or draft, context, 1, reps),
           "draft_module_decode_ms": _forward_ms(draft, context, 1, reps),
           "target_verify_ms": {g: _forward_ms(target, context, g + 1, reps) for g in gammas}}
    if eagle is not None:
        out["eagle_decode_ms"] = _forward_ms(lean_draft(eagle) or eagle, context, 1, reps)
        out["eagle_module_decode_ms"] = _forward_ms(eagle, context, 1, reps)
    return out


def draft_shapes(draft: torch.nn.Module, costs: dict[str, Any], rows: list[dict[str, Any]],
                 target_speedup: float = 1.5, reps: int = 30) -> list[dict[str, Any]]:
    """Would a differently shaped draft pay? Per shape: its bare forward cost (random weights,
    the draft's vocabulary, the LeanDraft forward; cost does not depend on the weights), and,
    from the engine's measured costs for the shipped draft (``engine_ms`` of the draft_model
    rows), the α it would need for ``target_speedup`` at each γ and the speed-up it would give
    at the shipped draft's measured α. In the engine a draft token costs what the shipped one
    did plus the difference of the bare forwards; the rest of a speculative step (verify,
    overhead) is as measured; a plain step is ``engine_plain_step``."""
    from labkit.model.llama import LlamaForCausalLM
    from labkit.spec.theory import alpha_needed, cpu_speedup

    cfg, plain = draft.config, costs["engine_plain_step"]
    measured = {r["gamma"]: r for r in rows if r["proposer"] == "draft_model"}
    out = []
    for layers, hidden, heads, kv, ffn in DRAFT_SHAPES:
        shape = dataclasses.replace(cfg, num_hidden_layers=layers, hidden_size=hidden,
                                    num_attention_heads=heads, num_key_value_heads=kv,
                                    intermediate_size=ffn, head_dim=hidden // heads)
        torch.manual_seed(0)
        model = LlamaForCausalLM(shape).eval()
        bare = _forward_ms(lean_draft(model) or model, 64, 1, reps)
        row = {"layers": layers, "hidden": hidden, "heads": [heads, kv], "ffn": ffn,
               "parameters": sum(p.numel() for p in model.parameters()), "bare_ms": bare,
               "draft_cost_c": bare / costs["target_decode_ms"], "alpha_needed": {},
               "speedup_at_measured_alpha": {}}
        for g, r in measured.items():
            e = r["engine_ms"]
            per_token = (e["draft_per_token"] + bare - costs["draft_decode_ms"]) / plain
            rest = (e["per_step"] - e["propose_per_step"]) / plain  # verify + overhead
            row["alpha_needed"][g] = alpha_needed(target_speedup, g, per_token, rest)
            row["speedup_at_measured_alpha"][g] = cpu_speedup(r["alpha"], g, per_token, rest)
        out.append(row)
    return out


def sim_rows(alpha_by_gamma: dict[int, float], cfg: dict[str, Any] = SIM) -> list[dict]:
    """Roofline prediction for a 7B target and a 1B-class draft on a GPU preset, batch 1."""
    from labkit.sim.cost import attention_pairs, step_time

    ctx = cfg["context"]
    t_dec = step_time(cfg["target"], cfg["gpu"], 0, 1, ctx)
    t_draft = step_time(cfg["draft"], cfg["gpu"], 0, 1, ctx)
    rows = []
    for g, alpha in alpha_by_gamma.items():
        t_ver = step_time(cfg["target"], cfg["gpu"], 0, g + 1, ctx,
                          attention_pairs=attention_pairs(ctx, g + 1))
        e = expected_tokens_per_step(alpha, g)
        tps = e / (g * t_draft + t_ver)
        rows.append({"proposer": f"sim:{cfg['draft']}->{cfg['target']}@{cfg['gpu']}",
                     "gamma": g, "tokens_per_s": tps, "baseline_tokens_per_s": 1 / t_dec,
                     "speedup": tps * t_dec, "acceptance_rate": alpha,
                     "predicted_speedup": expected_speedup(alpha, g, t_draft / t_dec),
                     "outputs_match": None, "measured": False,
                     "draft_cost_c": t_draft / t_dec, "verify_over_decode": t_ver / t_dec})
    return rows


def _best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold repeated runs of one config: the fastest wall and the least CPU time."""
    best = dict(min(results, key=lambda r: r["cpu_s"]))
    best["wall_s"] = min(r["wall_s"] for r in results)
    return best


def _configs(gammas: list[int], draft: torch.nn.Module,
             eagle: torch.nn.Module | None) -> list[tuple[str, int, dict | None]]:
    """(proposer, γ, speculative config) to run: plain decoding, then n-gram, the draft model
    and (if given) EAGLE at every γ."""
    configs: list[tuple[str, int, dict | None]] = [("baseline", 0, None)]
    for g in gammas:
        configs.append(("ngram", g, {"method": "ngram", "num_speculative_tokens": g,
                                     "prompt_lookup_max": 4}))
        configs.append(("draft_model", g, {"method": "draft_model", "model": draft,
                                           "num_speculative_tokens": g}))
        if eagle is not None:
            configs.append(("eagle", g, {"method": "eagle", "model": eagle,
                                         "num_speculative_tokens": g}))
    return configs


def _spec_row(name: str, g: int, r: dict[str, Any], base: dict[str, Any], costs: dict[str, Any],
              draft_ms: float, overhead_ms: float) -> dict[str, Any]:
    """One measured row: the speed-up over plain decoding (CPU and wall time) beside what the
    cost model predicts from this machine's raw forward costs and the measured acceptance."""
    n_tok, t_dec = base["num_tokens"], costs["target_decode_ms"]
    base_wall, base_cpu = n_tok / base["wall_s"], n_tok / base["cpu_s"]
    alpha, parts = r["acc"].alpha, r["cpu_parts_s"]
    c = draft_ms / t_dec
    # cost side with this machine's raw forward costs, token side as measured
    d = r["drafts_per_step"]
    cpu_model = r["tokens_per_step"] * (t_dec + overhead_ms) / (
        d * c * t_dec + costs["target_verify_ms"][g] + overhead_ms)
    tps, tps_wall = r["num_tokens"] / r["cpu_s"], r["num_tokens"] / r["wall_s"]
    vs = max(r["verify_steps"], 1)
    return {"proposer": name, "gamma": g, "tokens_per_s": tps,
            "baseline_tokens_per_s": base_cpu, "speedup": tps / base_cpu,
            "acceptance_rate": r["acc"].acceptance_rate,
            "predicted_speedup": expected_speedup(alpha, g, c),
            "outputs_match": r["tokens"] == base["tokens"], "measured": True,
            "wall_tokens_per_s": tps_wall, "wall_baseline_tokens_per_s": base_wall,
            "wall_speedup": tps_wall / base_wall,
            "predicted_speedup_cpu": cpu_model, "alpha": alpha,
            "mean_accepted": r["acc"].mean_accepted,
            "tokens_per_step": r["tokens_per_step"], "drafts_per_step": d,
            "alpha_per_position": r["acc"].alpha_per_position, "draft_cost_c": c,
            "engine_ms": {
                "per_step": 1e3 * r["cpu_s"] / vs,
                "target_per_step": 1e3 * parts.get("target", 0.0) / vs,
                "draft_per_token": 1e3 * parts.get("propose", 0.0) / max(r["num_drafted"], 1),
                "propose_per_step": 1e3 * parts.get("propose", 0.0) / vs}}


def run(quick: bool = True, target_name: str = "labkit-tiny",
        draft_name: str = DEFAULT_DRAFT, prompt_set: str = "code_prompts",
        sizes: dict[str, Any] | None = None, concurrency: int = 1,
        eagle_name: str | None = None) -> dict[str, Any]:
    """``eagle_name``: also run an EAGLE head (rows ``eagle``)."""
    from labkit.model.loader import load_pretrained
    from labkit.sim.workloads import prompt_texts

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    target, tok = load_pretrained(target_name)
    draft, _ = load_pretrained(draft_name)
    eagle = load_eagle(eagle_name, target) if eagle_name else None
    prompts = [tok.encode(t) for t in prompt_texts(prompt_set)[: cfg["num_prompts"]]]
    gammas = cfg["gammas"]
    configs = _configs(gammas, draft, eagle)
    # every round runs every config once, so slow phases of a shared machine hit all of them
    raw: dict[tuple[str, int], list[dict]] = {(n, g): [] for n, g, _ in configs}
    todo = [(n, g, spec) for _ in range(cfg["rounds"]) for n, g, spec in configs]
    for name, g, spec in tqdm(todo, desc="bench spec", leave=False):
        raw[(name, g)].append(run_engine(target, prompts, cfg["max_tokens"], spec, concurrency))
    base = _best(raw[("baseline", 0)])
    costs = measure_costs(target, draft, gammas, eagle=eagle)
    t_dec = costs["target_decode_ms"]
    draft_ms = {"ngram": 0.0, "draft_model": costs["draft_decode_ms"],
                "eagle": costs.get("eagle_decode_ms", 0.0)}
    # engine CPU overhead per step beyond the model forward, from the plain run
    overhead_ms = max(0.0, 1e3 * base["cpu_s"] / base["num_steps"] - t_dec)
    rows = [_spec_row(name, g, _best(raw[(name, g)]), base, costs, draft_ms[name], overhead_ms)
            for name, g, _ in configs if name != "baseline"]
    alpha_by_gamma = {r["gamma"]: r["alpha"] for r in rows if r["proposer"] == "draft_model"}
    sim = sim_rows(alpha_by_gamma)
    return {"benchmark": "spec", "quick": quick, "target": target_name, "draft": draft_name,
            "eagle": eagle_name,
            "prompt_set": prompt_set, "num_prompts": len(prompts),
            "max_tokens": cfg["max_tokens"], "concurrency": concurrency, "rounds": cfg["rounds"],
            "baseline_runs": [{"wall_s": b["wall_s"], "cpu_s": b["cpu_s"]}
                              for b in raw[("baseline", 0)]],
            "costs_ms": {**costs, "engine_overhead_per_step": overhead_ms,
                         "engine_plain_step": 1e3 * base["cpu_s"] / base["num_steps"]},
            "metric": "tokens_per_s / speedup use the benchmark process's CPU time (equal to "
                      "wall time on an idle machine; on a shared one wall time mostly measures "
                      "the other processes); wall_* fields keep the wall-clock figures",
            "results": rows + sim, "sim_config": SIM,
            "draft_shapes": draft_shapes(draft, {**costs, "engine_plain_step": 1e3 * base[
                "cpu_s"] / base["num_steps"]}, rows),
            "environment": environment()}


def _eagle_name(arg: str | None) -> str | None:
    """--eagle: a head name or folder, 'none', or unset (the shipped head, if there is one)."""
    from labkit.model.loader import models_dir

    if arg is None:
        return DEFAULT_EAGLE if (models_dir() / DEFAULT_EAGLE / "config.json").is_file() else None
    return None if arg == "none" else arg


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("spec", __doc__.splitlines()[0])
    p.add_argument("--prompt-set", default="code_prompts",
                   help="datasets/workloads/<name>.jsonl (e.g. spec_code_prompts)")
    p.add_argument("--target", default="labkit-tiny")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help="draft model (labkit-tiny-draft: the one trained on its own)")
    p.add_argument("--eagle", default=None,
                   help=f"EAGLE head to run beside it (default: {DEFAULT_EAGLE} if shipped; "
                        "'none': no eagle rows)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests decoding together (max_num_seqs); speculation pays most at 1")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: a 5M-parameter model gains nothing from more)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over all configs, each config's best kept (default: 2, quick 1);"
                        " more rounds ride out a machine whose speed drifts")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(args.threads)
    payload = run(args.quick, args.target, args.draft, args.prompt_set,
                  sizes={"rounds": args.rounds} if args.rounds else None,
                  concurrency=args.concurrency,
                  eagle_name=_eagle_name(args.eagle))
    print_report(payload, SIM)
    write_results(args.json, payload, partial(write_chart, SIM=SIM))
    ok = all(r["outputs_match"] for r in payload["results"] if r["measured"])
    if not ok:
        print("MISMATCH: a speculative output differs from the plain output")
    return 0 if ok else 1
