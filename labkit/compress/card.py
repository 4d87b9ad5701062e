"""The card of a distilled (or pruned-and-healed) model, and its loss / agreement curve.

Every number is measured on the exported float16 files as ``load_pretrained`` gives them:
held-out perplexity of student and teacher, and top-1 agreement with the teacher on the
teacher's greedy continuations of the probe prompts (= greedy per-token acceptance α), with
the acceptance rate theory predicts from it at γ = 2 and 4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch import nn

from labkit.compress.distill import Probe, probe_agreement
from labkit.model.config import ModelConfig
from labkit.model.loader import load_pretrained
from labkit.train.card import shipped_metrics


def expected_acceptance_rate(alpha: float, gamma: int) -> float:
    """accepted / proposed for i.i.d. per-token acceptance α: Σ_{i=1..γ} α^i / γ."""
    return sum(alpha**i for i in range(1, gamma + 1)) / gamma


def write_distill_card(out: str | Path, name: str, student: nn.Module, teacher: nn.Module,
                       log: dict, data, probe: Probe) -> dict:
    """README.md + distill_log.json (+ train_log.json, the fields every shipped card has)."""
    out = Path(out)
    tc = log["train_config"]
    shipped = shipped_metrics(out, data.heldout, tc["seq_len"], tc["eval_max_tokens"])
    loaded, _ = load_pretrained(out)
    agree = probe_agreement(loaded, teacher, probe)
    t_loss = shipped_metrics(log.get("teacher_dir", log["teacher"]), data.heldout,
                             tc["seq_len"], tc["eval_max_tokens"], 1)["heldout_loss_fp16_weights"]
    cfg = loaded.config
    summary = _summary(shipped, t_loss, agree, log["eval"][0])
    lines = _facts_table(name, cfg, log, shipped, agree, summary, len(probe))
    lines += ["", "Command:", "", "```", log["command"], "```", ""]
    lines += _agreement_curve(log["eval"])
    lines += ["", "Greedy completions (48 new tokens, float32 on CPU):", ""]
    for s in shipped["samples"]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    full = {**log, "shipped": shipped, "summary": summary, "num_parameters": cfg.num_parameters(),
            "data": data.meta, "model_config": cfg.to_hf_dict()}
    (out / "distill_log.json").write_text(json.dumps(full, indent=1) + "\n")
    (out / "train_log.json").write_text(json.dumps(full, indent=1) + "\n")
    return summary


def _summary(shipped: dict, t_loss: float, agree: dict, first: dict) -> dict:
    """The headline numbers: perplexities of student and teacher, α before and after, and the
    acceptance rate α predicts at γ = 2 and 4."""
    return {"heldout_loss_fp16_weights": shipped["heldout_loss_fp16_weights"],
            "heldout_perplexity": math.exp(shipped["heldout_loss_fp16_weights"]),
            "teacher_heldout_perplexity": math.exp(t_loss),
            "probe_alpha": agree["top1_agreement"], "probe_kl": agree["kl"],
            "probe_alpha_at_start": first.get("top1_agreement"),
            **{f"expected_acceptance_gamma{g}":
               expected_acceptance_rate(agree["top1_agreement"], g) for g in (2, 4)}}


def _facts_table(name: str, cfg: ModelConfig, log: dict, shipped: dict, agree: dict, summary: dict,
                 probe_len: int) -> list[str]:
    """Title, provenance and the facts table, every number measured or read from the log."""
    tc, kd = log["train_config"], log["distill"]
    n_params = cfg.num_parameters()
    first = log["eval"][0]
    return [
        f"# {name}", "",
        f"A {n_params / 1e6:.2f} M-parameter Llama-architecture student **distilled** from "
        f"`{log['teacher']}` by `labkit distill` (labkit.compress.distill) on the lab's corpus "
        "(Python stdlib sources + `pydoc_data.topics`), starting from "
        f"{log['student_init']}. The teacher ran on the fly on every batch.", "",
        "| | |", "|---|---|",
        f"| parameters | {n_params:,} |",
        f"| shape | d {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, FFN "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size} |",
        f"| loss | {kd['direction']} KL, temperature {kd['temperature']:g} (x T²), hard-label "
        f"weight {kd['hard_weight']:g}"
        f"{' (label: the teacher argmax)' if kd.get('hard_label') == 'teacher' else ''} |",
        *_spec_data_rows(log),
        f"| steps | {log['steps']} x batch {tc['batch_size']} x {tc['seq_len']} tokens = "
        f"{log['tokens_seen']:,} tokens, AdamW lr {tc['lr']:g} (warm-up {tc['warmup_steps']}, "
        f"cosine), seed {tc['seed']} |",
        f"| wall time | {log['wall_time_s']:.0f} s on {log.get('device_name', 'CPU')} "
        "(shared with other work) |",
        f"| held-out loss of these float16 weights | "
        f"{shipped['heldout_loss_fp16_weights']:.4f} (perplexity "
        f"{summary['heldout_perplexity']:.2f}; teacher "
        f"{summary['teacher_heldout_perplexity']:.2f}) |",
        f"| top-1 agreement with the teacher (α) on its greedy continuations of "
        f"{probe_len} code prompts | {agree['top1_agreement']:.3f} (before distillation "
        f"{first.get('top1_agreement', float('nan')):.3f}) |",
        f"| acceptance rate theory predicts from α (γ = 2 / 4) | "
        f"{summary['expected_acceptance_gamma2']:.3f} / "
        f"{summary['expected_acceptance_gamma4']:.3f} — measured in the engine by "
        "`labkit bench spec` |",
        f"| software | torch {log.get('torch_version', '?')}, Python "
        f"{log.get('python_version', '?')} |"]


def _spec_data_rows(log: dict) -> list[str]:
    """The data row of a DistillSpec run (teacher-written rows mixed in); none otherwise."""
    if not log.get("spec_data_rows"):
        return []
    return [f"| data | {log['teacher_text_fraction']:.0%} of each batch's rows from "
            f"{log['spec_data_rows']:,} continuations written by the teacher itself "
            f"(DistillSpec-style; {log['spec_data_sampled']:.0%} sampled at temperature "
            f"{log['spec_data_temperature']:g}, the rest greedy) of line-start prompts of 1-3 "
            "lines cut from the TRAIN split; prompts containing any line of the evaluation "
            "prompt sets (`code_prompts`, `spec_code_prompts`) were dropped; the other rows: "
            "corpus windows |"]


def _agreement_curve(evals: list[dict]) -> list[str]:
    """Held-out loss, α and KL during distillation, thinned to about 12 rows plus the last."""
    keep = evals if len(evals) <= 12 else evals[:: math.ceil(len(evals) / 12)] + [evals[-1]]
    return ["Agreement and held-out loss during distillation:", "",
            "| step | tokens | held-out loss | top-1 agreement α | KL(teacher‖student) |",
            "|---|---|---|---|---|"] + [
        f"| {e['step']} | {e['tokens_seen']:,} | {e['heldout_loss']:.4f} | "
        f"{e.get('top1_agreement', float('nan')):.3f} | {e.get('kl', float('nan')):.3f} |"
        for e in keep]


def distill_chart(log: dict):
    """plotly figure: distillation loss, held-out loss and top-1 agreement against step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss", "top-1 agreement α (probe)"))
    tr, ev = log["train"], log["eval"]
    fig.add_trace(go.Scatter(x=[r["step"] for r in tr], y=[r["loss"] for r in tr],
                             name="distillation loss (train)"), 1, 1)
    fig.add_trace(go.Scatter(x=[r["step"] for r in ev], y=[r["heldout_loss"] for r in ev],
                             name="held-out CE"), 1, 1)
    if ev and "top1_agreement" in ev[0]:
        fig.add_trace(go.Scatter(x=[r["step"] for r in ev], y=[r["top1_agreement"] for r in ev],
                                 name="α", mode="lines+markers"), 1, 2)
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=380, width=900, title="distillation")
    return fig
