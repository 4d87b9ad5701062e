"""``labkit prune``: structured pruning + least-squares refit + distillation healing, saved
Hugging Face-style with its healing curve.

    labkit prune --model labkit-tiny --out /tmp/pruned --heal-steps 400 --time-budget 4500

Perplexity and KL from the dense model are measured on the held-out windows ``labkit bench
compress`` uses (16 x 256 tokens), right after pruning, after the refit, and every
``--eval-every`` healing steps; at each of those the model so far is exported to ``--out``
(a checkpoint: stop the run any time, then ``labkit prune --out DIR --finish``).
``prune_log.json`` beside it holds the command, the counts, the curve and a power-law
extrapolation of the tokens the 5% target needs; ``--chart`` writes the curve as HTML.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from labkit.compress.recipe import PruneRecipe

TARGET = 1.05  # healed perplexity within 5% of the dense model's


def build_parser() -> argparse.ArgumentParser:
    d = PruneRecipe()
    p = argparse.ArgumentParser(prog="labkit prune", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="labkit-tiny")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None,
                   help="prepared-data directory for healing (`labkit train --prepare-only`); "
                        "default: built from this Python's stdlib with the model's tokenizer")
    p.add_argument("--sparsity", type=float, default=d.sparsity,
                   help="fraction of the decoder's linear weights to remove")
    p.add_argument("--head-fraction", type=float, default=d.head_fraction,
                   help="fraction of the query heads of every KV group; the FFN gives the rest")
    p.add_argument("--importance", default=d.importance,
                   choices=("magnitude", "activation", "gradient"))
    p.add_argument("--calib-windows", type=int, default=d.calib_windows)
    p.add_argument("--heal-steps", type=int, default=d.heal_steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--time-budget", type=float, default=None, help="stop healing after SECONDS")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows of 256")
    p.add_argument("--device", default="cpu", help="where healing runs (cpu, cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chart", metavar="HTML", help="write the healing curve")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="continue healing the pruned model in DIR (a `labkit prune` output) "
                        "for --heal-steps more steps; its curve and log carry on into --out")
    p.add_argument("--finish", action="store_true",
                   help="only complete --out's log, card and chart from its last checkpoint "
                        "(after stopping a run)")
    return p


def healing_chart(log: dict):
    """plotly: held-out perplexity against healing tokens, with the dense model and the target."""
    import plotly.graph_objects as go

    curve, dense = log["curve"], log["dense"]["perplexity"]
    fig = go.Figure(go.Scatter(x=[max(r["tokens"], 1) for r in curve],
                               y=[r["perplexity"] for r in curve], mode="lines+markers",
                               name=f"pruned {log['counts']['decoder_sparsity']:.1%}, healing"))
    fig.add_hline(y=dense, line_dash="dot", annotation_text=f"dense {dense:.2f}")
    fig.add_hline(y=TARGET * dense, line_dash="dash", annotation_text="dense + 5%")
    fig.update_layout(title="healing by distillation from the dense model", height=420,
                      width=760, xaxis_title="healing tokens (log)", xaxis_type="log",
                      yaxis_title="held-out perplexity")
    return fig


def write_prune_card(out: Path, log: dict, name: str | None = None) -> str:
    """README.md beside the pruned model: what was removed, perplexity at every stage, the curve
    and the command (every number from ``prune_log.json``)."""
    c, r = log["counts"], log["recipe"]
    heads, ffn = c["query_heads"], c["ffn_channels"]
    dense = log["dense"]["perplexity"]
    last = log["curve"][-1]
    extra = log.get("extrapolated_tokens_to_target")
    lines = [
        f"# {name or out.name}", "",
        f"`{log['model']}` with {c['decoder_sparsity']:.1%} of its decoder's linear weights "
        f"removed by structured pruning (`labkit prune`, labkit.compress): query heads "
        f"{heads[0]} → {heads[1]} (the same per KV group), FFN channels {ffn[0]} → {ffn[1]} in "
        f"every layer, chosen by {r['importance']} importance; then a least-squares refit of "
        f"every o_proj / down_proj on {r['calib_windows']} × {r['calib_len']} train tokens, then "
        "healing by distillation (forward KL, T = 1) from the dense model. A smaller dense Llama: "
        "it loads with `load_pretrained` and runs in the engine"
        + ("; transformers 5 refuses its config (hidden size not heads × head_dim)"
           if log["counts"].get("hf_incompatible") else " and in transformers") + ".", "",
        "| | |", "|---|---|",
        f"| parameters | {c['parameters'][1]:,} ({c['parameters'][0]:,} dense, "
        f"−{c['parameter_reduction']:.1%} with the embedding) |",
        f"| held-out perplexity ({log['eval']}) | dense {dense:.2f}; pruned "
        f"{log['one_shot']['perplexity']:.2f}; refit {log['refit']['perplexity']:.2f}; healed "
        f"**{last['perplexity']:.2f}** (KL from dense {last['kl']:.3f}) |",
        f"| healing | {last['step']} steps × {r['batch_size']} × {r['seq_len']} tokens = "
        f"{last['tokens']:,} tokens, AdamW {_schedules(log)}, "
        f"{log['wall_time_s'] / 60:.0f} min on a shared 2-core CPU, "
        f"{log['torch_threads']} torch thread |",
        f"| target (healed ≤ dense + 5% = {log['target_perplexity']:.2f}) | "
        f"{'reached' if log['target_reached'] else 'not reached'}"
        + (f"; a power law fitted to the curve's second half reaches it after "
           f"~{extra / 1e6:.1f} M tokens (optimistic if the curve flattens)"
           if extra and not log["target_reached"] else "")
        + " |",
        "", "Commands:" if log.get("segments") else "Command:", "", "```",
        *[g["command"] for g in log.get("segments", [log])], "```", "",
        "| step | tokens | perplexity | KL |", "|---|---|---|---|"]
    lines += [f"| {e['step']} | {e['tokens']:,} | {e['perplexity']:.2f} | {e['kl']:.3f} |"
              for e in log["curve"]]
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    return text


def _schedules(log: dict) -> str:
    """The learning-rate schedule of every healing segment (one, or more after ``--resume``)."""
    segs = log.get("segments") or [{"start_step": 0, **_schedule(log["recipe"])}]
    ends = [g["start_step"] for g in segs[1:]] + [log["curve"][-1]["step"]]
    parts = []
    for g, end in zip(segs, ends, strict=True):
        done = end - g["start_step"]
        parts.append(f"steps {g['start_step']}-{end}: lr {g['lr']:g} (warm-up "
                     f"{g['warmup_steps']}, cosine over {g['heal_steps']} steps"
                     f"{'' if done >= g['heal_steps'] else ', stopped'}, seed {g['seed']})")
    return "; ".join(parts) if len(parts) > 1 else parts[0].split(": ", 1)[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.finish:
        finish(args.out, args.chart)
        return 0
    from labkit.compress.recipe import heal
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.quant.calib import corpus_windows
    from labkit.train.data import load_token_data, prepare_data
    from labkit.train.export import export_hf

    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = _recipe(args)
    t0 = time.perf_counter()
    dense, tok = load_pretrained(args.model)
    tdir = resolve_model_path(args.model)
    data = load_token_data(args.data or prepare_data(tokenizer_dir=tdir))
    ev = corpus_windows(tok, "heldout", args.eval_windows, 256)
    calib = corpus_windows(tok, "train", recipe.calib_windows, recipe.calib_len, seed=1)
    metrics = _metrics_against(dense, ev)
    command = "labkit prune " + shlex.join(argv)
    if args.resume:
        pruned, log, base = _resumed(args.resume, command, recipe)
    else:
        pruned, log = _pruned_and_refit(dense, calib, recipe, metrics, args, command)
        base = {"step": 0, "tokens": 0, "wall_time_s": 0.0}
    print(json.dumps({k: log[k] for k in ("dense", "one_shot", "refit", "counts")}),
          file=sys.stderr, flush=True)

    def checkpoint(row: dict) -> None:
        if base["step"] and row["step"] == 0:
            return  # the resumed-from checkpoint is already the curve's last row
        row = {**row, "step": row["step"] + base["step"],
               "tokens": row["tokens"] + base["tokens"]}
        print(json.dumps(row), file=sys.stderr, flush=True)
        export_hf(pruned, pruned.config, tdir, args.out)
        log["curve"].append(row)
        _write_log(args.out, log, t0, base["wall_time_s"])

    pruned, curve = heal(pruned, dense, data.train.to(args.device), recipe, metrics,
                         args.time_budget, args.eval_every, on_eval=checkpoint,
                         device=args.device)
    _write_log(args.out, log, t0, base["wall_time_s"])
    finish(args.out, args.chart)
    return 0


def _recipe(args: argparse.Namespace) -> PruneRecipe:
    """The flags as the recipe ``prune_and_refit`` and ``heal`` read (and the log records)."""
    return PruneRecipe(sparsity=args.sparsity, head_fraction=args.head_fraction,
                       importance=args.importance, calib_windows=args.calib_windows,
                       heal_steps=args.heal_steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                       seed=args.seed)


def _metrics_against(dense: torch.nn.Module,
                     ev: torch.Tensor) -> Callable[[torch.nn.Module], dict]:
    """Perplexity on the held-out windows ``ev`` and mean KL from the dense model there (its
    log-probs computed once, here)."""
    from labkit.quant.evaluate import log_probs, mean_kl, perplexity_from_logprobs

    ref = log_probs(dense, ev)

    def metrics(m: torch.nn.Module) -> dict:
        lp = log_probs(m, ev)
        return {"perplexity": perplexity_from_logprobs(lp, ev), "kl": mean_kl(ref, lp)}

    return metrics


def _pruned_and_refit(dense: torch.nn.Module, calib: torch.Tensor, recipe: PruneRecipe,
                      metrics: Callable[[torch.nn.Module], dict], args: argparse.Namespace,
                      command: str) -> tuple[torch.nn.Module, dict]:
    """Prune and refit ``dense``; the log opens with the dense, one-shot and refit metrics
    (the healing curve starts from the refit)."""
    from labkit.compress.recipe import prune_and_refit

    pruned, counts = prune_and_refit(dense, calib, recipe)
    log = {"model": args.model, "command": command, "recipe": asdict(recipe),
           "dense": metrics(dense), "one_shot": metrics(counts.pop("one_shot")),
           "refit": metrics(pruned), "counts": counts, "curve": [],
           "eval": f"{args.eval_windows} held-out windows x 256 tokens",
           "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__}
    return pruned, log


def _resumed(src: Path, command: str, recipe: PruneRecipe) -> tuple[torch.nn.Module, dict, dict]:
    """The pruned model saved in ``src``, its log with this run added as a healing segment,
    and where the new segment starts (step, tokens, wall time so far)."""
    from labkit.model.loader import load_pretrained

    if not (src / "prune_log.json").is_file():
        raise FileNotFoundError(f"--resume {src}: no prune_log.json there; pass a `labkit prune` "
                          "output folder")
    log = json.loads((src / "prune_log.json").read_text())
    model, _ = load_pretrained(src)
    last = log["curve"][-1]
    segments = log.setdefault("segments", [{"command": log["command"], "start_step": 0,
                                            **_schedule(log["recipe"])}])
    segments.append({"command": command, "start_step": last["step"],
                     **_schedule(asdict(recipe))})
    base = {"step": last["step"], "tokens": last["tokens"], "wall_time_s": log["wall_time_s"]}
    return model.float(), log, base


def _schedule(recipe: dict) -> dict:
    return {k: recipe[k] for k in ("heal_steps", "lr", "warmup_steps", "seed")}


def finish(out: Path, chart: str | None = None) -> dict:
    """Complete ``out/prune_log.json`` (target, extrapolation), its card and chart from the
    last checkpoint: the end of a run, or ``labkit prune --finish DIR`` after stopping one."""
    from labkit.compress.recipe import power_law_tokens

    log = json.loads((out / "prune_log.json").read_text())
    curve, dense = log["curve"], log["dense"]["perplexity"]
    log.update(healed=curve[-1], target_perplexity=TARGET * dense,
               target_reached=curve[-1]["perplexity"] <= TARGET * dense,
               extrapolated_tokens_to_target=power_law_tokens(curve, TARGET * dense, dense))
    (out / "prune_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_prune_card(out, log)
    if chart:
        healing_chart(log).write_html(chart, include_plotlyjs="cdn")
    print(json.dumps({"out": str(out), "healed": log["healed"],
                      "target_reached": log["target_reached"]}))
    return log


def _write_log(out: Path, log: dict, t0: float, before_s: float = 0.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log["wall_time_s"] = before_s + time.perf_counter() - t0
    (out / "prune_log.json").write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
