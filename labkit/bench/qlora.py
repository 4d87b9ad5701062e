"""``labkit bench qlora``: the QLoRA deployment path, measured (perplexity and weight bytes).

A QLoRA adapter is trained against the NF4 base: it learned to correct ``deq(nf4(W))``, not W.
How it is deployed decides whether that correction survives. The run trains (seeded) a QLoRA
adapter on one style slice of the stdlib (``labkit finetune --lora --qlora``'s code; or takes
``--adapter``), then measures perplexity on the slice's held-out functions for:

* ``fp_base``: the full-precision base alone, and ``fp_base_adapter``: the fp32 base with the
  adapter (references: the adapter was not trained on this base);
* ``nf4_base``: the NF4 base alone;
* ``a_nf4_adapter``: (a) NF4 base + adapter, unmerged, exactly as trained;
* ``b_nf4_naive_merge``: (b) ``nf4(deq(nf4(W)) + s B A)``: merged and re-quantized to NF4;
* ``c_fp_merged``: ``deq(nf4(W)) + s B A`` in float32 (equals (a) up to rounding), and
  ``c_gptq_merged``: (c) that, GPTQ 4-bit (calibrated on the slice's training text; group 64
  by default, one scale per 64 weights like NF4's blocks, so the two 4-bit formats compare at
  the same granularity), served
  through the engine (``labkit lora merge --quantize gptq`` writes this checkpoint);
* ``d_nf4_unmerged`` / ``d_gptq_unmerged``: (d) the adapter served unmerged through labkit's
  multi-LoRA engine path (``LLM(enable_lora=True)``, ``LoRARequest``) over the NF4 base and
  over a GPTQ base (GPTQ of the original W: not the base the adapter learned against);

with each system's weight bytes as held in memory (``model_bytes``: quantized linears packed,
embeddings / norms / lm_head in float32 as this CPU engine holds them; unmerged rows add the
adapter's float32 A and B). Engine rows score the windows with ``prompt_logprobs``, so they are
measured through the serving path itself. Perplexity and bytes do not depend on machine load,
so the committed JSON holds no timings.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"steps": 40, "max_chars": 120_000, "heldout_chars": 20_000, "eval_windows": 8,
         "calib_windows": 16}
FULL = {"steps": 150, "max_chars": 400_000, "heldout_chars": 40_000, "eval_windows": 32,
        "calib_windows": 32}
SEQ_LEN = 128
SYSTEMS = ("fp_base", "fp_base_adapter", "nf4_base", "a_nf4_adapter", "b_nf4_naive_merge",
           "c_fp_merged", "c_gptq_merged", "d_nf4_unmerged", "gptq_base", "d_gptq_unmerged")


def _windows(ids: torch.Tensor, n: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    n = min(n, ids.numel() // seq_len)
    if n < 1:
        raise ValueError(f"{ids.numel()} tokens are fewer than one {seq_len}-token window")
    return ids[:n * seq_len].view(n, seq_len)


def forward_ppl(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Perplexity of the windows by a plain batched forward."""
    from labkit.quant.evaluate import log_probs, perplexity_from_logprobs

    return perplexity_from_logprobs(log_probs(model, windows), windows)


def engine_ppl(model: torch.nn.Module, windows: torch.Tensor, adapter: str | None = None,
               rank: int = 8) -> float:
    """Perplexity through labkit's engine: the windows as prompts with ``prompt_logprobs``,
    with the adapter (if given) served unmerged by the multi-LoRA path."""
    import math

    from labkit import LLM, LoRARequest, SamplingParams

    kw = {"enable_lora": True, "max_loras": 1, "max_lora_rank": rank} if adapter else {}
    llm = LLM.from_model(model, None, enable_prefix_caching=False, **kw)
    req = LoRARequest("qlora", 1, adapter) if adapter else None
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(prompt_token_ids=windows.tolist(), sampling_params=sp,
                        lora_request=req, use_tqdm=False)
    nll, n = 0.0, 0
    for w, o in zip(windows.tolist(), outs):
        for tok, entry in zip(w[1:], o.prompt_logprobs[1:]):
            nll -= entry[tok].logprob
            n += 1
    return math.exp(nll / n)


def adapter_bytes(adapter: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(str(Path(adapter) /
                                                     "adapter_model.safetensors")).values())


def train_adapter(base: Path, train_ids: torch.Tensor, heldout_ids: torch.Tensor, out: Path,
                  steps: int, seed: int) -> str:
    """A seeded QLoRA adapter (finetune's code path), written as a PEFT folder + its log."""
    from labkit.lora.writer import save_peft_adapter
    from labkit.model.loader import load_model
    from labkit.train.lora_finetune import (
        LoRATrainConfig,
        adapter_weights,
        finetune_lora,
        prepare_base,
    )

    cfg = LoRATrainConfig(qlora=True, steps=steps, seed=seed, seq_len=SEQ_LEN,
                          eval_every=steps, eval_max_tokens=4096)
    model = prepare_base(load_model(base, dtype=torch.float32, device="cpu"), cfg)
    layers, log = finetune_lora(model, cfg, train_ids, heldout_ids)
    save_peft_adapter(out, adapter_weights(layers), cfg.r, cfg.alpha, base_model=str(base))
    log.pop("wall_time_s", None)
    (out / "finetune_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return str(out)


def measure(base: Path, adapter: str, eval_w: torch.Tensor, calib_w: torch.Tensor,
            group_size: int = 64) -> dict[str, dict[str, Any]]:
    """Every system above: perplexity and weight bytes."""
    from labkit.lora.cli import gptq, merged_model, trained_on_nf4
    from labkit.lora.merge import merge_lora
    from labkit.model.loader import load_model
    from labkit.quant.evaluate import model_bytes
    from labkit.quant.model import quantize_model
    from labkit.train.lora_finetune import load_adapter_layers

    _, blocksize = trained_on_nf4(Path(adapter))
    rank = json.loads((Path(adapter) / "adapter_config.json").read_text())["r"]
    extra = adapter_bytes(adapter)
    fp = load_model(base, dtype=torch.float32, device="cpu").eval()
    nf4 = quantize_model(fp, "nf4", blocksize=blocksize)
    a_model = quantize_model(fp, "nf4", blocksize=blocksize)
    load_adapter_layers(a_model, adapter)
    fp_ad = load_model(base, dtype=torch.float32, device="cpu")
    load_adapter_layers(fp_ad, adapter)
    c_fp = merged_model(base, adapter, nf4_base=True, blocksize=blocksize)
    c_gptq = gptq(merged_model(base, adapter, nf4_base=True, blocksize=blocksize), calib_w,
                  group_size=group_size)
    gptq_base = gptq(load_model(base, dtype=torch.float32, device="cpu"), calib_w,
                     group_size=group_size)
    naive = merge_lora(nf4, adapter, "nf4")
    rows = {
        "fp_base": (forward_ppl(fp, eval_w), model_bytes(fp)),
        "fp_base_adapter": (forward_ppl(fp_ad, eval_w), model_bytes(fp) + extra),
        "nf4_base": (forward_ppl(nf4, eval_w), model_bytes(nf4)),
        "a_nf4_adapter": (forward_ppl(a_model, eval_w), model_bytes(nf4) + extra),
        "b_nf4_naive_merge": (forward_ppl(naive, eval_w), model_bytes(naive)),
        "c_fp_merged": (forward_ppl(c_fp, eval_w), model_bytes(c_fp)),
        "c_gptq_merged": (engine_ppl(c_gptq, eval_w), model_bytes(c_gptq)),
        "gptq_base": (engine_ppl(gptq_base, eval_w), model_bytes(gptq_base)),
    }
    d_nf4_bytes, d_gptq_bytes = model_bytes(nf4) + extra, model_bytes(gptq_base) + extra
    rows["d_nf4_unmerged"] = (engine_ppl(nf4, eval_w, adapter, rank), d_nf4_bytes)
    rows["d_gptq_unmerged"] = (engine_ppl(gptq_base, eval_w, adapter, rank), d_gptq_bytes)
    pairs = zip(_nf4_layers(nf4), _nf4_layers(naive))
    changed = sum(int((a.packed != b.packed).sum()) for (_, a), (_, b) in pairs)
    total = sum(int(n.packed.numel()) for _, n in _nf4_layers(nf4))
    return {s: {"perplexity": rows[s][0], "weight_bytes": int(rows[s][1])} for s in SYSTEMS} \
        | {"_naive_merge_bytes_changed": {"fraction": changed / total}}


def _nf4_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from labkit.quant.linear import NF4Linear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, NF4Linear)]


def run(model: str = "labkit-tiny", quick: bool = True, style: str = "docstring",
        adapter: str | None = None, seed: int = 0, sizes: dict[str, Any] | None = None,
        group_size: int = 64) -> dict[str, Any]:
    """Everything above; returns the JSON payload."""
    from labkit.model.loader import resolve_model_path
    from labkit.train.lora_data import build_slice, slice_token_ids
    from labkit.train.tokenizer import load_tokenizer

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    base = resolve_model_path(model)
    sl = build_slice(style, max_chars=cfg["max_chars"], heldout_chars=cfg["heldout_chars"])
    train_ids, heldout_ids = slice_token_ids(load_tokenizer(base), sl)
    eval_w = _windows(heldout_ids, cfg["eval_windows"])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.numel() - SEQ_LEN, (cfg["calib_windows"],), generator=g)
    calib_w = torch.stack([train_ids[s:s + SEQ_LEN] for s in starts.tolist()])
    with tempfile.TemporaryDirectory() as tmp:
        if adapter is None:
            adapter_src = "trained here: labkit finetune --lora --qlora's code, seed " + str(seed)
            adapter = train_adapter(base, train_ids, heldout_ids, Path(tmp) / "qlora",
                                    cfg["steps"], seed)
        else:
            adapter_src = str(adapter)
        rows = measure(base, adapter, eval_w, calib_w, group_size)
    naive = rows.pop("_naive_merge_bytes_changed")["fraction"]
    env = environment()
    env.pop("run_s", None)  # a duration: this result holds no timings
    return {"benchmark": "qlora", "model": str(model), "quick": quick, "style": style,
            "adapter": adapter_src, "adapter_steps": cfg["steps"], "seq_len": SEQ_LEN,
            "eval_windows": int(eval_w.shape[0]), "calib_windows": cfg["calib_windows"],
            "nf4_blocksize": 64, "gptq_bits": 4, "gptq_group_size": group_size,
            "systems": list(SYSTEMS), "perplexity": {s: rows[s]["perplexity"] for s in SYSTEMS},
            "weight_bytes": {s: rows[s]["weight_bytes"] for s in SYSTEMS},
            "naive_merge_nf4_bytes_changed": naive,
            "a_vs_d_nf4_rel_diff": abs(rows["a_nf4_adapter"]["perplexity"] -
                                       rows["d_nf4_unmerged"]["perplexity"]) /
            rows["a_nf4_adapter"]["perplexity"],
            "environment": env}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    import plotly.graph_objects as go

    s = payload["systems"]
    fig = go.Figure(go.Bar(x=s, y=[payload["perplexity"][k] for k in s],
                           text=[f"{payload['weight_bytes'][k] / 1e6:.1f} MB" for k in s]))
    fig.update_layout(title=f"QLoRA deployment on {payload['model']}: held-out perplexity on "
                      f"the {payload['style']} slice (bar text: weight bytes)",
                      yaxis_title="perplexity (lower is better)")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("qlora", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny", help="shipped model name or folder")
    p.add_argument("--style", default="docstring", help="the slice the adapter trains on")
    p.add_argument("--adapter", help="a QLoRA adapter folder (default: train one here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=64,
                   help="GPTQ group size (64: one scale per 64 weights, as NF4's blocks)")
    args = p.parse_args(argv)
    payload = run(args.model, quick=args.quick, style=args.style, adapter=args.adapter,
                  seed=args.seed, group_size=args.group_size)
    print_table([{"system": s, "perplexity": payload["perplexity"][s],
                  "weight MB": payload["weight_bytes"][s] / 1e6} for s in payload["systems"]])
    print(f"naive NF4 re-quantize changed {payload['naive_merge_nf4_bytes_changed']:.1%} of the "
          f"packed bytes; (a) vs (d, NF4) perplexity differ by "
          f"{payload['a_vs_d_nf4_rel_diff']:.2e} (relative)")
    write_results(args.json, payload, write_chart)
    return 0
