"""``labkit bench kv-formats``: what each KV layout costs per token, and what that buys.

The KV cache, not the weights, bounds how many long requests a GPU serves at once, and the
models of 2026 each cut it differently: fewer KV heads (GQA, MQA), one latent per token (MLA),
a window per layer (sliding), fewer bits (FP8, INT8). This experiment puts every layout labkit
runs into the same fixed KV pool (bytes) on tiny models (seeded random Llama MHA / GQA / MQA /
all-sliding Mistral configs, a tiny DeepSeek-V3 written by transformers' ``save_pretrained``, and
the shipped labkit-tiny with ``kv_cache_dtype`` auto / fp8 / int8) and reports, per layout:
KV bytes per token, the blocks the pool holds, how many sequences fit by count, how many the
engine actually ran at once (sequences at different lengths share the pool, so the peak can
pass the count of full-length ones; a sliding model prefills a whole prompt before its old
blocks are freed, so it stays below its count), and whether the engine's greedy tokens equal
the reference (the model's own non-paged ``generate``; for FP8 / INT8 the contiguous quantized
cache). Beside it: FP8 and INT8 KV perplexity and KL against fp32 on labkit-tiny's held-out
text, MLA's absorbed vs expanded decode step time on this CPU, and the simulator's table of
concurrent 32k-token requests per H200 (``labkit.sim.kv_capacity``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, print_table, timed, write_results

QUICK = {"block_size": 8, "window": 8, "num_requests": 8, "prompt_len": 32, "max_tokens": 8,
         "pool_seqs_fp32": 2, "ppl": (4, 64),
         "mla": {"heads": 16, "kv_lora_rank": 64, "rope": 16, "nope": 32, "v": 32,
                 "context": 256, "batch": 4, "rounds": 3}}
FULL = {**QUICK, "num_requests": 16, "prompt_len": 64, "max_tokens": 32, "pool_seqs_fp32": 4,
        "ppl": (16, 256),
        "mla": {"heads": 128, "kv_lora_rank": 512, "rope": 64, "nope": 128, "v": 128,
                "context": 2048, "batch": 8, "rounds": 10}}
TINY_LLAMA = {"mha": dict(num_key_value_heads=4), "gqa": {}, "mqa": dict(num_key_value_heads=1)}
DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                max_position_embeddings=256, eos_token_id=None)


def tiny_deepseek(folder: str) -> torch.nn.Module:
    """A seeded random DeepSeek-V3 (MLA) saved by transformers and loaded by labkit."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from labkit.model.loader import load_model

    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)).save_pretrained(folder)
    return load_model(folder)


def layout_models(cfg: dict[str, Any], folder: str) -> dict[str, tuple[torch.nn.Module, str]]:
    """layout name -> (model, kv_cache_dtype)."""
    from labkit.kv.cache import QUANT_KV
    from labkit.model.loader import load_pretrained
    from labkit.model.testing import tiny_model

    out = {k: (tiny_model(0, **kw), "auto") for k, kw in TINY_LLAMA.items()}
    out["sliding"] = (tiny_model(0, sliding_window=cfg["window"],
                                 architecture="MistralForCausalLM"), "auto")
    out["mla"] = (tiny_deepseek(folder), "auto")
    lt, _ = load_pretrained("labkit-tiny")
    for dt in ("auto", "fp8", "int8"):
        if dt == "auto" or dt in QUANT_KV:  # fp8 needs torch's float8_e4m3fn
            out[f"labkit-tiny-{dt}"] = (lt, dt)
    return out


def reference(model: torch.nn.Module, prompt: list[int], n: int, kv_cache_dtype: str) -> list:
    """Greedy tokens off the engine: ``generate``, or the contiguous quantized cache."""
    from labkit.bench.kv_int8_engine import int8_reference_greedy
    from labkit.kv.cache import QUANT_KV
    from labkit.model.generate import generate

    if kv_cache_dtype == "auto":
        return generate(model, prompt, n, ignore_eos=True)
    return int8_reference_greedy(model, prompt, n, QUANT_KV[kv_cache_dtype])


def engine_row(name: str, model: torch.nn.Module, kv_cache_dtype: str, pool_bytes: int,
               cfg: dict[str, Any]) -> dict[str, Any]:
    """One layout in the fixed pool: bytes, blocks, sequences by count and as run, match."""
    from labkit.bench.common import greedy_params
    from labkit.engine.llm import LLM
    from labkit.kv.hybrid import freeable_window, peak_blocks

    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    prompts = [torch.randint(1, v, (cfg["prompt_len"],), generator=g).tolist()
               for _ in range(cfg["num_requests"])]
    bs = cfg["block_size"]
    llm = LLM.from_model(model, None, kv_cache_bytes=pool_bytes, block_size=bs,
                         kv_cache_dtype=kv_cache_dtype, max_num_seqs=cfg["num_requests"],
                         enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=greedy_params(cfg["max_tokens"]))
    eng = llm.llm_engine
    s = eng.stats()
    want = [reference(model, p, cfg["max_tokens"], kv_cache_dtype) for p in prompts]
    seq_len = cfg["prompt_len"] + cfg["max_tokens"]
    window = freeable_window(model.config)
    return {"layout": name, "kv_cache_dtype": kv_cache_dtype,
            "kv_bytes_per_token": s["kv_bytes_per_block"] / bs, "num_blocks": s["num_blocks"],
            "sequences_fit": s["num_blocks"] // peak_blocks(seq_len, bs, window),
            "peak_running": max(st["queues"]["running"] for st in eng.trace.steps),
            "window_freed_blocks": eng.block_manager.num_window_freed,
            "outputs_match": [o.outputs[0].token_ids for o in outs] == want}


def quant_kv_perplexity(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """labkit-tiny's held-out perplexity and KL from fp32 with its K/V through FP8 / INT8."""
    from labkit.kv.cache import QUANT_KV
    from labkit.model.loader import load_pretrained
    from labkit.quant.calib import corpus_windows
    from labkit.quant.evaluate import log_probs, mean_kl, perplexity_from_logprobs
    from labkit.quant.kv_int8 import Int8ContiguousKVCache

    model, tok = load_pretrained("labkit-tiny")
    tokens = corpus_windows(tok, "heldout", *cfg["ppl"])
    ref = log_probs(model, tokens)
    rows = [{"kv": "fp32", "perplexity": perplexity_from_logprobs(ref, tokens), "kl": 0.0}]
    for name, code in QUANT_KV.items():
        lp = log_probs(model, tokens, kv_cache_factory=lambda m, b, t, c=code:
                       Int8ContiguousKVCache(m, b, t, c))
        rows.append({"kv": name, "perplexity": perplexity_from_logprobs(lp, tokens),
                     "kl": mean_kl(ref, lp)})
    return rows


def mla_decode_times(c: dict[str, Any]) -> dict[str, Any]:
    """One decode step of an MLA layer: absorbed (latents read in place) vs expanded (every
    cached latent up-projected to per-head K and V first), same inputs, on this CPU."""
    from transformers import DeepseekV3Config

    from labkit.kv.mla import mla_decode_absorbed, mla_decode_expanded
    from labkit.model.config import ModelConfig
    from labkit.model.llama import LlamaForCausalLM

    hf = {**DeepseekV3Config(**{**DEEPSEEK, "num_hidden_layers": 1, "hidden_size": 256,
                                "num_attention_heads": c["heads"],
                                "num_key_value_heads": c["heads"],
                                "kv_lora_rank": c["kv_lora_rank"], "qk_rope_head_dim": c["rope"],
                                "qk_nope_head_dim": c["nope"], "v_head_dim": c["v"],
                                "first_k_dense_replace": 1}).to_dict(),
          "architectures": ["DeepseekV3ForCausalLM"]}
    torch.manual_seed(0)
    mla = LlamaForCausalLM(ModelConfig.from_hf_dict(hf)).model.layers[0].self_attn.eval()
    B, S, bs, H = c["batch"], c["context"], 16, c["heads"]
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(B * S // bs, bs, 1, c["kv_lora_rank"] + c["rope"], generator=g)
    bt = torch.arange(B * S // bs).view(B, S // bs)
    ctx = torch.full((B,), S)
    q_nope = torch.randn(B, H, c["nope"], generator=g)
    q_pe = torch.randn(B, H, c["rope"], generator=g)
    with torch.inference_mode():
        w_uk, w_uv = mla.w_uk(), mla.w_uv()
        absorbed = lambda: mla_decode_absorbed(q_nope, q_pe, cache, bt, ctx, w_uk, w_uv,  # noqa: E731
                                               mla.scale)
        expanded = lambda: mla_decode_expanded(q_nope, q_pe, cache, bt, ctx, mla)  # noqa: E731
        a, e = absorbed(), expanded()
        t_abs = min(timed(absorbed)[1].wall_s for _ in range(c["rounds"]))
        t_exp = min(timed(expanded)[1].wall_s for _ in range(c["rounds"]))
    return {**c, "absorbed_ms": 1e3 * t_abs, "expanded_ms": 1e3 * t_exp,
            "expanded_over_absorbed": t_exp / t_abs,
            "max_abs_diff": float((a - e).abs().max())}


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from labkit.kv.cache import kv_bytes_per_block
    from labkit.sim.kv_capacity import capacity_table
    from labkit.sim.presets import get_model_preset

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    with tempfile.TemporaryDirectory() as folder:
        models = layout_models(cfg, folder)
        lt = models["labkit-tiny-auto"][0].config  # the pool: this many fp32 labkit-tiny seqs
        pool = cfg["pool_seqs_fp32"] * (cfg["prompt_len"] + cfg["max_tokens"]) * \
            kv_bytes_per_block(lt.num_hidden_layers, 1, lt.num_key_value_heads, lt.head_dim,
                               torch.float32)
        rows = [engine_row(n, m, dt, pool, cfg) for n, (m, dt) in models.items()]
        ds = models["mla"][0].config
    by = {r["layout"]: r for r in rows}
    mha_same_heads = 2 * ds.num_hidden_layers * ds.num_attention_heads * ds.mla.v_head_dim * 4
    v3 = get_model_preset("deepseek-v3")
    return {"benchmark": "kv-formats", "quick": quick, "config": cfg, "pool_bytes": pool,
            "rows": rows, "outputs_match": all(r["outputs_match"] for r in rows),
            "mla_vs_mha_bytes": by["mla"]["kv_bytes_per_token"] / mha_same_heads,
            "mla_vs_mha_bytes_deepseek_v3": v3.kv_bytes_per_token
            / (2 * v3.num_layers * v3.num_heads * v3.head_dim * v3.kv_dtype_bytes),
            "quant_kv_perplexity": quant_kv_perplexity(cfg),
            "mla_decode": mla_decode_times(cfg["mla"]),
            "capacity_h200_32k": capacity_table(), "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    from plotly.subplots import make_subplots

    rows, cap = payload["rows"], payload["capacity_h200_32k"]
    fig = make_subplots(1, 2, subplot_titles=(
        "tiny models in one KV pool", "concurrent 32k-token requests per H200 (simulated)"))
    names = [r["layout"] for r in rows]
    fig.add_bar(x=names, y=[r["sequences_fit"] for r in rows], name="sequences fit (count)",
                row=1, col=1)
    fig.add_bar(x=names, y=[r["peak_running"] for r in rows], name="peak running (engine)",
                row=1, col=1)
    models = [r["model"] for r in cap]
    fig.add_bar(x=models, y=[r["max_requests_no_freeing"] for r in cap],
                name="keeping every block", row=1, col=2)
    fig.add_bar(x=models, y=[r["max_requests"] for r in cap],
                name="sliding layers hold their window", row=1, col=2)
    fig.update_layout(title="KV layouts: bytes per token decide concurrency", barmode="group",
                      height=450, width=1100)
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("kv-formats", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["layout", "kv_cache_dtype", "kv_bytes_per_token",
                                  "num_blocks", "sequences_fit", "peak_running",
                                  "window_freed_blocks", "outputs_match"])
    print_table(payload["quant_kv_perplexity"], ["kv", "perplexity", "kl"])
    m = payload["mla_decode"]
    print(f"MLA decode, {m['heads']} heads x {m['context']} tokens: absorbed "
          f"{m['absorbed_ms']:.2f} ms, expanded {m['expanded_ms']:.2f} ms; MLA / MHA bytes "
          f"{payload['mla_vs_mha_bytes']:.4f} (DeepSeek-V3: "
          f"{payload['mla_vs_mha_bytes_deepseek_v3']:.4f})")
    print_table(payload["capacity_h200_32k"], ["model", "weight_gib", "kv_gib_per_request",
                                               "max_requests", "max_requests_no_freeing"])
    write_results(args.json, payload, write_chart)
    return 0
