"""The model card (README.md) and train_log.json written beside every exported model.

Every number on the card is read from the run's log or measured on the exported files
themselves: the held-out loss is recomputed from the float16 safetensors as a user loads them
(float32 math on CPU), and the sample completions come from `labkit.model.generate.generate`
on that same loaded model, so what the card shows is what `load_pretrained` gives.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from labkit.model.generate import generate
from labkit.model.loader import load_pretrained
from labkit.model.moe import expert_load
from labkit.train.trainer import evaluate

SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n",
                  "    for i in range(", '"""Return the')


def shipped_metrics(model_dir: str | Path, heldout: torch.Tensor, seq_len: int,
                    max_tokens: int | None = None, max_new_tokens: int = 48) -> dict:
    """Held-out loss and greedy samples of the exported folder, loaded like a user loads it."""
    model, tok = load_pretrained(model_dir, dtype=torch.float32, device="cpu")
    loss = evaluate(model, heldout.cpu(), seq_len, batch_size=8, max_tokens=max_tokens)
    out: dict = {"heldout_loss_fp16_weights": loss}
    if model.config.moe_layers:  # tokens per expert over the first 8 held-out windows
        with torch.no_grad():
            model(heldout[:8 * seq_len].cpu().view(8, seq_len))
        out["expert_load"] = {str(i): v for i, v in expert_load(model).items()}
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt)
        new = generate(model, ids, max_new_tokens)
        samples.append({"prompt": prompt, "completion": tok.decode(new)})
    out["samples"] = samples
    return out


def compare_models(model_dirs: list[str | Path], heldout: torch.Tensor, seq_len: int,
                   max_tokens: int | None = None) -> list[dict]:
    """Held-out loss of other model folders measured exactly as :func:`shipped_metrics`
    measures the exported one (same windows, float32 on CPU), for the card's comparison."""
    rows = []
    for d in model_dirs:
        model, _ = load_pretrained(d, dtype=torch.float32, device="cpu")
        c = model.config
        train_log = Path(d) / "train_log.json"
        other = json.loads(train_log.read_text()) if train_log.is_file() else {}
        rows.append({"model": Path(d).name, "path": str(d), "steps": other.get("steps"),
                     "tokens_seen": other.get("tokens_seen"),
                     "parameters": c.num_parameters(), "active": c.num_parameters(active=True),
                     "heldout_loss": evaluate(model, heldout.cpu(), seq_len, batch_size=8,
                                              max_tokens=max_tokens)})
    return rows


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def write_card(model_dir: str | Path, name: str, log: dict, data_meta: dict, command: str,
               shipped: dict) -> None:
    """README.md + train_log.json in `model_dir`."""
    out = Path(model_dir)
    lines = [*_intro(name, log), "", *_facts_table(log, data_meta, shipped), "", "Command:", "",
             "```", command, "```"]
    lines += _run_notes(log, data_meta, command)
    lines += _eval_table(log["eval"])
    lines += _moe_sections(log, shipped)
    lines += ["", "Greedy completions (`labkit.model.generate.generate`, 48 new tokens, "
              "float32 on CPU):", ""]
    for s in shipped["samples"]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    lines += [""]
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    (out / "train_log.json").write_text(json.dumps({**log, "shipped": shipped,
                                                    "data": data_meta, "command": command},
                                                   indent=1) + "\n")


def _intro(name: str, log: dict) -> list[str]:
    """Title and what the model is for: a reader meets the purpose before the numbers."""
    cfg = log["model_config"]
    moe = bool(cfg.get("num_local_experts") or cfg.get("num_experts"))
    arch = cfg["architectures"][0].removesuffix("ForCausalLM")
    kind = "mixture-of-experts" if moe else "model"
    return [
        f"# {name}",
        "",
        f"A {_fmt_params(log['num_parameters'])}-parameter {arch}-architecture {kind} trained by "
        "`labkit train` on the Python standard library's `.py` sources and `pydoc_data.topics`.",
        ("It exists so the lab has a mixture of experts to look inside with no downloads: its "
         "router, its expert load, its kernels; its text is far from labkit-tiny's."
         if moe else "It exists so the lab runs with no downloads: it writes plausible-looking "
         "Python, not correct programs."),
    ]


def _facts_table(log: dict, data_meta: dict, shipped: dict) -> list[str]:
    """The run's facts, each read from the log, the data's metadata or the shipped weights."""
    cfg = log["model_config"]
    last_eval = log["eval"][-1]
    loss16 = shipped["heldout_loss_fp16_weights"]
    tc = log["train_config"]
    tokens_per_s = log["tokens_seen"] / max(log["wall_time_s"], 1e-9)
    epochs = log["tokens_seen"] / max(1, data_meta["train_tokens"])
    emb = cfg["vocab_size"] * cfg["hidden_size"]
    return [
        "| | |",
        "|---|---|",
        f"| parameters | {log['num_parameters']:,} ({_fmt_params(emb)} in the tied embedding) |",
        *_moe_rows(cfg, log),
        f"| shape | d {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, head dim "
        f"{cfg['head_dim']}, FFN {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, context "
        f"{cfg['max_position_embeddings']} |",
        f"| tokens seen | {log['tokens_seen']:,} ({epochs:.1f} passes over "
        f"{data_meta['train_tokens']:,} train tokens) |",
        f"| steps | {log['steps']} x batch {tc['batch_size']} x {tc['seq_len']} tokens |",
        f"| optimizer | AdamW lr {tc['lr']:g}, betas {tuple(tc['betas'])}, weight decay "
        f"{tc['weight_decay']}, warm-up {tc['warmup_steps']} steps, cosine to "
        f"{tc['min_lr_ratio']:g} x lr, clip {tc['grad_clip']}, seed {tc['seed']} |",
        f"| wall time | {log['wall_time_s']:.1f} s on {log.get('device_name', tc['device'])} "
        f"({tokens_per_s:,.0f} tokens/s including evaluations) |",
        f"| held-out loss (training precision, step {last_eval['step']}) | "
        f"{last_eval['heldout_loss']:.4f} (perplexity {math.exp(last_eval['heldout_loss']):.2f}) |",
        f"| held-out loss of these float16 weights (float32 math) | {loss16:.4f} (perplexity "
        f"{math.exp(loss16):.2f}) |",
        f"| held-out set | {data_meta['heldout_documents']} files chosen by sha256 of their path, "
        f"{data_meta['heldout_tokens']:,} tokens"
        + (f" (evaluations read the first {tc['eval_max_tokens']:,})"
           if tc.get("eval_max_tokens") else "") + " |",
        f"| corpus | Python {data_meta['python_version']} stdlib, fingerprint "
        f"`{data_meta['corpus_fingerprint'][:16]}` |",
        f"| tokenizer | byte-level BPE, sha256 `{data_meta['tokenizer_sha256'][:16]}` |",
        f"| software | torch {log.get('torch_version', '?')}, "
        f"Python {log.get('python_version', '?')} |",
    ]


def _run_notes(log: dict, data_meta: dict, command: str) -> list[str]:
    """How to repeat the run: where ``--data`` came from, the step count a time budget fixed."""
    lines: list[str] = []
    if "--data" in command:
        lines += ["", "`--data` names a directory made by `labkit train --prepare-only` (corpus "
                  f"of Python {data_meta['python_version']}); without it `labkit train` builds "
                  "the same directory from the running Python's standard library."]
    if "resolved_max_steps" in log:
        r = log["resolved_max_steps"]
        lines += ["", f"The time budget resolved to `--max-steps {r['max_steps']}` after timing "
                  f"{r['step_s'] * 1e3:.1f} ms per step; pass that flag instead of "
                  "`--time-budget` to repeat the run step for step."]
    return lines


def _eval_table(evals: list[dict]) -> list[str]:
    """The held-out curve, thinned to about 12 rows (the last evaluation always kept)."""
    lines = ["", "Held-out loss during training:", "", "| step | tokens seen | held-out loss |",
             "|---|---|---|"]
    keep = evals if len(evals) <= 12 else evals[:: math.ceil(len(evals) / 12)]
    if keep[-1] is not evals[-1]:
        keep.append(evals[-1])
    return lines + [f"| {e['step']} | {e['tokens_seen']:,} | {e['heldout_loss']:.4f} |"
                    for e in keep]


def _moe_rows(cfg: dict, log: dict) -> list[str]:
    """Table rows only an MoE has: experts, active parameters, the final auxiliary losses."""
    if "active_parameters" not in log:
        return []
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    last = log["train"][-1]
    tc = log["train_config"]
    return [f"| experts | {experts} per layer of width {width}, top-"
            f"{cfg['num_experts_per_tok']} (softmax over all, then top-k, renormalised) |",
            f"| active parameters per token | {log['active_parameters']:,} |",
            f"| auxiliary losses | load balancing x {tc['aux_loss_coef']:g} (last: "
            f"{last.get('balance_loss', float('nan')):.4f}; 1.0 = even), router z x "
            f"{tc['z_loss_coef']:g} (last: {last.get('z_loss', float('nan')):.4f}) |"]


def _moe_sections(log: dict, shipped: dict) -> list[str]:
    """Expert load at the end and the comparison with other models measured the same way."""
    lines: list[str] = []
    load = shipped.get("expert_load")
    if load:
        lines += ["", "Expert load of the shipped weights (tokens routed to each expert over the "
                  "first 8 held-out windows; a token counts once per expert it chose):", "",
                  "| layer | " + " | ".join(f"e{e}" for e in range(len(next(iter(
                      load.values()))))) + " | max / mean |",
                  "|---" * (len(next(iter(load.values()))) + 2) + "|"]
        for layer, row in load.items():
            ratio = max(row) * len(row) / max(1, sum(row))
            lines.append(f"| {layer} | " + " | ".join(map(str, row)) + f" | {ratio:.2f} |")
    rows = shipped.get("compare")
    if rows:
        mine = shipped["heldout_loss_fp16_weights"]
        lines += ["", "Held-out loss beside other models, measured the same way (same windows, "
                  "float32 on CPU):", "", "| model | parameters | active per token | tokens "
                  "trained on | held-out loss | perplexity |", "|---|---|---|---|---|---|",
                  f"| this model | {log['num_parameters']:,} | "
                  f"{log.get('active_parameters', log['num_parameters']):,} | "
                  f"{log['tokens_seen']:,} | {mine:.4f} | {math.exp(mine):.2f} |"]
        lines += [f"| {r['model']} | {r['parameters']:,} | {r['active']:,} | "
                  f"{r['tokens_seen'] or 0:,} | {r['heldout_loss']:.4f} | "
                  f"{math.exp(r['heldout_loss']):.2f} |" for r in rows]
        lines += _verdict(log, mine, rows)
    return lines


def _verdict(log: dict, mine: float, rows: list[dict]) -> list[str]:
    """The MoE promise, judged against a compared model with the same active parameters
    (within 1 %) trained for the same steps: read from the numbers, never written by hand."""
    active = log.get("active_parameters")
    twins = [r for r in rows if active and abs(r["active"] - active) <= 0.01 * active
             and r.get("steps") == log["steps"]]
    if not twins:
        return []
    t = twins[0]
    gap = t["heldout_loss"] - mine
    holds = "holds" if gap > 0 else "does not hold"
    return ["", f"**More quality for the same active compute {holds} at this size and budget:** "
            f"against {t['model']} ({t['active']:,} parameters, all active, the same "
            f"{log['steps']} steps on the same batches), this model's held-out loss is "
            f"{abs(gap):.4f} nats {'lower' if gap > 0 else 'higher'} (perplexity "
            f"{math.exp(mine):.2f} vs {math.exp(t['heldout_loss']):.2f}), holding "
            f"{log['num_parameters'] / t['parameters']:.1f}x the parameters."]
