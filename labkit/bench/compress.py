"""``labkit bench compress``: what pruning costs in accuracy, saves in bytes, and what healing
(a distillation from the dense model) wins back, on labkit-tiny.

Side by side in one run: dense; structured pruning with :class:`PruneRecipe`'s defaults (25.0%
of the decoder's linear weights: 1 of 4 query heads per KV group and 187 of 704 FFN channels in
every layer) with magnitude, activation and gradient (Taylor) importance, each repaired by a
least-squares refit of the output projections on 128 x 256 train tokens, then a short healing;
unstructured magnitude at 50%; 2:4 semi-structured (50%). Each: held-out perplexity and mean KL
from the dense model right after pruning, after the refit, after healing; parameters, fp16 bytes
(dense storage) and the bytes a sparse format would need, CPU decode tokens per CPU-second, and
for the structured models whether greedy decoding through the engine equals the reference.

Also: how to split 25% between heads and FFN channels (one-shot and refit); a sweep of
structured sparsity (activation importance; one-shot, then refit); and the shipped
``labkit-tiny-pruned`` (the same recipe healed for long by ``labkit prune``, whose command and
healing curve are copied from its ``prune_log.json``), measured here like the others.

Healing data are train-split windows, evaluation windows the held-out split (as bench quant).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"eval": (4, 128), "heal_windows": 16, "heal_steps": 4, "batch": 4, "seq": 128,
         "sweep": [0.25, 0.5], "allocation": [0.0, 0.25], "decode_tokens": 8, "rounds": 1,
         "calib": (16, 256)}
FULL = {"eval": (16, 256), "heal_windows": 512, "heal_steps": 30, "batch": 8, "seq": 256,
        "sweep": [0.125, 0.25, 0.375, 0.5], "allocation": [0.0, 0.25, 0.5], "decode_tokens": 32,
        "rounds": 2, "calib": (128, 256)}  # refit perplexity 26.2 / 24.2 / 21.6 / 21.1 with
#                                            32 / 64 / 128 / 256 calibration windows
SHIPPED = "labkit-tiny-pruned"  # `labkit prune` with the defaults, healed for long


def _decoder_params(model) -> int:
    from labkit.compress.prune import decoder_weights

    return sum(w.numel() for w in decoder_weights(model).values())


def _nonzero(model) -> int:
    from labkit.compress.prune import decoder_weights

    return sum(int(w.count_nonzero()) for w in decoder_weights(model).values())


def _sparse_bytes(model, pattern: str | None) -> int:
    """fp16 bytes with the decoder weights in a sparse format: CSR-like (value + 16-bit index)
    for unstructured, values + 2 bits of position per kept value for 2:4; dense otherwise."""
    total = sum(p.numel() for p in model.parameters()) * 2
    if pattern is None:
        return total
    nnz, dec = _nonzero(model), _decoder_params(model)
    per_kept = 4.0 if pattern == "magnitude" else 2.25
    return int(total - dec * 2 + nnz * per_kept)


def _engine_matches(model, prompt: list[int], n: int = 16) -> bool:
    from labkit import LLM, SamplingParams
    from labkit.model.generate import generate

    out = LLM(model).generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False))
    return out[0].outputs[0].token_ids == generate(model, prompt, n, ignore_eos=True)


def _short_recipe(s: dict, importance: str = "activation"):
    from labkit.compress.recipe import PruneRecipe

    return PruneRecipe(importance=importance, calib_windows=s["calib"][0],
                       calib_len=s["calib"][1], heal_steps=s["heal_steps"], batch_size=s["batch"],
                       seq_len=s["seq"], warmup_steps=max(1, s["heal_steps"] // 10))


def _allocation(pruned, s: dict) -> list[dict]:
    """25% of the decoder's linear weights split between heads and FFN channels in different
    ways: one-shot and refit perplexity (activation importance)."""
    rows = []
    for hf in s["allocation"]:
        pm, counts, one, refit = pruned("activation", hf, 0.25)
        rows.append({"head_fraction": hf, "query_heads": pm.config.num_attention_heads,
                     "ffn_channels": pm.config.intermediate_size,
                     "sparsity": counts["decoder_sparsity"], "perplexity": one["perplexity"],
                     "kl": one["kl"], "perplexity_refit": refit["perplexity"],
                     "kl_refit": refit["kl"]})
    return rows


def _sweep(pruned, s: dict) -> list[dict]:
    """Structured sparsity 12.5..50% (1 head per KV group + FFN channels), one-shot and refit."""
    out = []
    for target in s["sweep"]:
        _, counts, one, refit = pruned("activation", 0.25, target)
        out.append({"target_sparsity": target, "sparsity": counts["decoder_sparsity"], **one,
                    "perplexity_refit": refit["perplexity"], "kl_refit": refit["kl"]})
    return out


def _shipped_row(dense, metrics) -> tuple[dict, dict, object] | None:
    """The long-healed shipped model, measured here; its curve and command from its log."""
    import json

    from labkit.model.loader import CheckpointError, load_pretrained, resolve_model_path

    try:
        path = resolve_model_path(SHIPPED)
    except CheckpointError:
        return None
    log = json.loads((path / "prune_log.json").read_text())
    model, _ = load_pretrained(path)
    last = log["curve"][-1]
    row = {"method": "structured_activation_long_heal", "pattern": "structured",
           "importance": log["recipe"]["importance"],
           "sparsity": 1 - _decoder_params(model) / _decoder_params(dense), **metrics(model),
           "perplexity_before_heal": log["one_shot"]["perplexity"],
           "kl_before_heal": log["one_shot"]["kl"],
           "perplexity_refit": log["refit"]["perplexity"], "kl_refit": log["refit"]["kl"],
           "heal_steps": last["step"], "heal_tokens": last["tokens"],
           "seconds": log["wall_time_s"]}
    keep = ("command", "segments", "recipe", "counts", "dense", "one_shot", "refit", "curve",
            "target_perplexity", "target_reached", "extrapolated_tokens_to_target",
            "wall_time_s", "torch_threads")
    return row, {k: log.get(k) for k in keep}, model


def _evaluator(dense, eval_tokens):
    """m -> held-out perplexity and mean KL(dense || m) on ``eval_tokens``."""
    from labkit.quant.evaluate import log_probs, mean_kl, perplexity_from_logprobs

    ref_lp = log_probs(dense, eval_tokens)

    def metrics(m) -> dict[str, float]:
        lp = log_probs(m, eval_tokens)
        return {"perplexity": perplexity_from_logprobs(lp, eval_tokens), "kl": mean_kl(ref_lp, lp)}
    return metrics


def _measure_models(rows: list[dict], models: dict, prompt: list[int], s: dict) -> None:
    """Sizes, CPU decode speed (side by side, one run) and engine == reference, per row."""
    from labkit.bench.quant_speed import compare_decode

    speeds = compare_decode(models, prompt, s["decode_tokens"], s["rounds"])
    for r in rows:
        m, pat = models[r["method"]], r["pattern"]
        r.update(parameters=sum(p.numel() for p in m.parameters()),
                 fp16_bytes=sum(p.numel() for p in m.parameters()) * 2,
                 sparse_format_bytes=_sparse_bytes(m, pat if pat in ("magnitude", "2:4")
                                                   else None),
                 tokens_per_s=speeds[r["method"]]["tokens_per_s"],
                 speedup_vs_dense=speeds[r["method"]]["tokens_per_s"] /
                 speeds["dense"]["tokens_per_s"],
                 engine_matches_reference=_engine_matches(m, prompt)
                 if pat in ("dense", "structured") else None)


def _targets(rows: list[dict]) -> dict[str, bool]:
    base = rows[0]["perplexity"]
    return {"structured_25pct_healed_within_5pct_ppl": any(
                r["sparsity"] >= 0.25 and r["perplexity"] <= 1.05 * base
                for r in rows if r["pattern"] == "structured"),
            "engine_equals_reference": all(r["engine_matches_reference"] for r in rows
                                           if r["engine_matches_reference"] is not None)}


def refresh_shipped(path: str) -> dict[str, Any]:
    """Re-measure only dense and the shipped long-healed model (its row, healing curve, speed
    beside dense) and merge them into the results at ``path``: the long healing run finishes
    after the rest of the bench has been measured."""
    import json

    from labkit.model.loader import load_pretrained
    from labkit.quant.calib import corpus_windows

    payload = json.loads(open(path).read())
    s = FULL
    dense, tok = load_pretrained("labkit-tiny")
    eval_tokens = corpus_windows(tok, "heldout", *s["eval"])
    metrics = _evaluator(dense, eval_tokens)

    shipped = _shipped_row(dense, metrics)
    if shipped is None:
        raise ValueError(f"no shipped {SHIPPED} to measure: run `labkit prune` and copy it")
    row, payload["healing"], model = shipped
    dense_row = {**payload["results"][0], **metrics(dense)}
    _measure_models([dense_row, row], {"dense": dense, row["method"]: model},
                    eval_tokens[0, :16].tolist(), s)
    row["measured_separately"] = True  # speed relative to a dense model measured beside it
    rows = [r for r in payload["results"] if r["method"] != row["method"]] + [row]
    payload.update(results=rows, targets=_targets(rows))
    return payload


def _pruning_cache(dense, calib, s: dict, metrics):
    """``pruned(imp, head_fraction, sparsity)``, memoised: the allocation, the sweep and the
    structured rows ask for the same refits, and each costs an importance pass and a solve."""
    from labkit.compress.prune import importance
    from labkit.compress.recipe import prune_and_refit

    scores, cache = {}, {}

    def pruned(imp: str, head_fraction: float, sparsity: float):
        """(refit model, counts, one-shot metrics, refit metrics), each refit done once."""
        key = (imp, head_fraction, sparsity)
        if key not in cache:
            if imp not in scores:
                scores[imp] = importance(copy.deepcopy(dense), calib[:32], imp)
            rec = replace(_short_recipe(s, imp), head_fraction=head_fraction, sparsity=sparsity)
            pm, counts = prune_and_refit(dense, calib, rec, scores[imp])
            cache[key] = (pm, counts, metrics(counts.pop("one_shot")), metrics(pm))
        return cache[key]
    return pruned


def _prune_and_heal(rows: list[dict], models: dict, dense, pruned, train_stream, s: dict,
                    metrics, progress: bool) -> None:
    """One row and model per method (structured by three importances, unstructured, 2:4):
    pruned, then healed by the same short distillation, so only the pruning differs."""
    from labkit.compress.prune import apply_masks, prune_masked
    from labkit.compress.recipe import heal

    dec = _decoder_params(dense)
    todo = [(f"structured_{m}", "structured", m) for m in ("magnitude", "activation",
                                                            "gradient")] + \
        [("unstructured_magnitude", "magnitude", None), ("2:4", "2:4", None)]
    for name, pattern, imp in todo:
        t0 = time.perf_counter()
        masks, refit, recipe = None, {}, _short_recipe(s, imp or "activation")
        if pattern == "structured":
            pm, _, before, refit = pruned(imp, recipe.head_fraction, recipe.sparsity)
            pm = copy.deepcopy(pm)
            refit = {"perplexity_refit": refit["perplexity"], "kl_refit": refit["kl"]}
        else:
            pm, masks = prune_masked(dense, pattern, 0.5)
            before = metrics(pm)
        after_step = None if masks is None else (lambda m, masks=masks: apply_masks(m, masks))
        pm, curve = heal(pm, dense, train_stream, recipe, metrics, eval_every=10**6,
                         progress=progress, after_step=after_step)
        after = curve[-1]
        models[name] = pm
        kept = _decoder_params(pm) if pattern == "structured" else _nonzero(pm)
        rows.append({"method": name, "pattern": pattern, "importance": imp,
                     "sparsity": 1 - kept / dec, "perplexity": after["perplexity"],
                     "kl": after["kl"], "perplexity_before_heal": before["perplexity"],
                     "kl_before_heal": before["kl"], **refit, "heal_steps": after["step"],
                     "heal_tokens": after["tokens"], "seconds": time.perf_counter() - t0})
        print(f"{name}: ppl {before['perplexity']:.3f} -> healed {after['perplexity']:.3f}",
              flush=True)


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    from labkit.model.loader import load_pretrained
    from labkit.quant.calib import corpus_windows

    s = QUICK if quick else FULL
    torch.manual_seed(0)
    dense, tok = load_pretrained("labkit-tiny")
    eval_tokens = corpus_windows(tok, "heldout", *s["eval"])
    calib = corpus_windows(tok, "train", *s["calib"], seed=1)
    train_stream = corpus_windows(tok, "train", s["heal_windows"], s["seq"] + 1,
                                  seed=2).flatten()
    metrics = _evaluator(dense, eval_tokens)

    rows, models = [], {"dense": dense}
    rows.append({"method": "dense", "pattern": "dense", **metrics(dense), "sparsity": 0.0})
    pruned = _pruning_cache(dense, calib, s, metrics)
    allocation = _allocation(pruned, s)
    sweep = _sweep(pruned, s)
    _prune_and_heal(rows, models, dense, pruned, train_stream, s, metrics, progress)
    shipped = None if quick else _shipped_row(dense, metrics)
    if shipped is not None:
        rows.append(shipped[0])
        models[shipped[0]["method"]] = shipped[2]
    _measure_models(rows, models, eval_tokens[0, :16].tolist(), s)
    return {"model": "labkit-tiny", "quick": quick, "results": rows, "sweep": sweep,
            "allocation": allocation, "healing": None if shipped is None else shipped[1],
            "targets": _targets(rows),
            "settings": {**s, "recipe": asdict(_short_recipe(s)),
                         "heal": "forward KL from the dense model, T=1, AdamW, warm-up, "
                                 "cosine"},
            "environment": environment()}


def chart(payload: dict, path) -> None:
    """Two panels: perplexity against structured sparsity (one-shot, refit, healed) and the
    long healing curve of the shipped pruned model."""
    from plotly.subplots import make_subplots

    dense = payload["results"][0]["perplexity"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "structured sparsity (activation importance)", "healing labkit-tiny-pruned (25%)"))
    sw = payload["sweep"]
    for key, name in (("perplexity", "one-shot"), ("perplexity_refit", "least-squares refit")):
        fig.add_scatter(x=[r["sparsity"] for r in sw], y=[r[key] for r in sw], name=name,
                        mode="lines+markers", row=1, col=1)
    healed = [r for r in payload["results"] if r["pattern"] == "structured"]
    fig.add_scatter(x=[r["sparsity"] for r in healed], y=[r["perplexity"] for r in healed],
                    text=[r["method"] for r in healed], mode="markers", name="healed",
                    row=1, col=1)
    if payload.get("healing"):
        c = payload["healing"]["curve"]
        fig.add_scatter(x=[max(r["tokens"], 1) for r in c], y=[r["perplexity"] for r in c],
                        mode="lines+markers", name="healing (labkit prune)", row=1, col=2)
        fig.update_xaxes(type="log", title_text="healing tokens", row=1, col=2)
    for col in (1, 2):
        fig.add_hline(y=dense, line_dash="dot", row=1, col=col)
        fig.add_hline(y=1.05 * dense, line_dash="dash", row=1, col=col)
    fig.update_xaxes(title_text="decoder linear weights removed", row=1, col=1)
    fig.update_yaxes(title_text="held-out perplexity (dotted: dense, dashed: +5%)", type="log")
    fig.update_layout(title="Pruning labkit-tiny", height=440, width=1000)
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("compress", "pruning (structured, unstructured, 2:4) + distillation "
                                 "healing on labkit-tiny: perplexity, KL, bytes, speed")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--shipped-only", action="store_true",
                   help=f"measure only {SHIPPED} and merge it into the existing --json file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.shipped_only and not args.json:
        p.error("--shipped-only updates the results file named by --json")
    out = refresh_shipped(args.json) if args.shipped_only else run(args.quick)
    print_table(out["results"], ["method", "sparsity", "perplexity_before_heal",
                                 "perplexity_refit", "perplexity",
                                 "kl", "parameters", "sparse_format_bytes", "speedup_vs_dense",
                                 "engine_matches_reference"])
    print("25% split between heads and FFN channels (activation importance):")
    print_table(out["allocation"], ["head_fraction", "query_heads", "ffn_channels", "sparsity",
                                    "perplexity", "perplexity_refit", "kl_refit"])
    print("structured sweep (activation importance; one-shot, then least-squares refit):")
    print_table(out["sweep"], ["target_sparsity", "sparsity", "perplexity", "kl",
                               "perplexity_refit", "kl_refit"])
    for k, ok in out["targets"].items():
        print(f"target {k}: {'PASS' if ok else 'FAIL'}")
    write_results(args.json, out, chart)
    return 0
