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
from labkit.train.trainer import evaluate

SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n",
                  "    for i in range(", '"""Return the')


def shipped_metrics(model_dir: str | Path, heldout: torch.Tensor, seq_len: int,
                    max_tokens: int | None = None, max_new_tokens: int = 48) -> dict:
    """Held-out loss and greedy samples of the exported folder, loaded like a user loads it."""
    model, tok = load_pretrained(model_dir, dtype=torch.float32, device="cpu")
    loss = evaluate(model, heldout.cpu(), seq_len, batch_size=8, max_tokens=max_tokens)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt)
        new = generate(model, ids, max_new_tokens)
        samples.append({"prompt": prompt, "completion": tok.decode(new)})
    return {"heldout_loss_fp16_weights": loss, "samples": samples}


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def write_card(model_dir: str | Path, name: str, log: dict, data_meta: dict, command: str,
               shipped: dict) -> None:
    """README.md + train_log.json in `model_dir`."""
    out = Path(model_dir)
    cfg = log["model_config"]
    last_eval = log["eval"][-1]
    loss16 = shipped["heldout_loss_fp16_weights"]
    tc = log["train_config"]
    tokens_per_s = log["tokens_seen"] / max(log["wall_time_s"], 1e-9)
    epochs = log["tokens_seen"] / max(1, data_meta["train_tokens"])
    emb = cfg["vocab_size"] * cfg["hidden_size"]
    lines = [
        f"# {name}",
        "",
        f"A {_fmt_params(log['num_parameters'])}-parameter Llama-architecture model trained by "
        "`labkit train` on the Python standard library's `.py` sources and `pydoc_data.topics`.",
        "It exists so the lab runs with no downloads: it writes plausible-looking Python, not "
        "correct programs.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {log['num_parameters']:,} ({_fmt_params(emb)} in the tied embedding) |",
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
        f"{data_meta['heldout_tokens']:,} tokens |",
        f"| corpus | Python {data_meta['python_version']} stdlib, fingerprint "
        f"`{data_meta['corpus_fingerprint'][:16]}` |",
        f"| tokenizer | byte-level BPE, sha256 `{data_meta['tokenizer_sha256'][:16]}` |",
        f"| software | torch {log.get('torch_version', '?')}, "
        f"Python {log.get('python_version', '?')} |",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
    ]
    if "--data" in command:
        lines += ["", "`--data` names a directory made by `labkit train --prepare-only` (corpus "
                  f"of Python {data_meta['python_version']}); without it `labkit train` builds "
                  "the same directory from the running Python's standard library."]
    if "resolved_max_steps" in log:
        r = log["resolved_max_steps"]
        lines += ["", f"The time budget resolved to `--max-steps {r['max_steps']}` after timing "
                  f"{r['step_s'] * 1e3:.1f} ms per step; pass that flag instead of "
                  "`--time-budget` to repeat the run step for step."]
    lines += ["", "Held-out loss during training:", "", "| step | tokens seen | held-out loss |",
              "|---|---|---|"]
    evals = log["eval"]
    keep = evals if len(evals) <= 12 else evals[:: math.ceil(len(evals) / 12)]
    if keep[-1] is not evals[-1]:
        keep.append(evals[-1])
    lines += [f"| {e['step']} | {e['tokens_seen']:,} | {e['heldout_loss']:.4f} |" for e in keep]
    lines += ["", "Greedy completions (`labkit.model.generate.generate`, 48 new tokens, "
              "float32 on CPU):", ""]
    for s in shipped["samples"]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    (out / "train_log.json").write_text(json.dumps({**log, "shipped": shipped,
                                                    "data": data_meta, "command": command},
                                                   indent=1) + "\n")
