"""The structured-pruning recipe `labkit prune` and `labkit bench compress` run: score, prune,
refit by least squares, heal by distillation from the dense model, with a perplexity curve.

Every default below was measured on labkit-tiny (numbers in the README's compression section):
* 25% of the decoder's linear weights, as 1 of 4 query heads per KV group + FFN channels
  (one-shot + refit perplexity 26.2, against 29.7 FFN-only and 30.5 with 2 heads per group);
* activation importance (Wanda-like), the best of the three after the refit;
* the refit on many calibration tokens: a ridge fit of a 517-input ``down_proj`` overfits
  8 K tokens (refit perplexity 26.2) and keeps improving up to 64 K (see ``calib_windows``);
* healing by forward KL from the dense teacher (Minitron: logit distillation recovers far more
  per token than the LM loss), AdamW with warm-up and cosine decay, 8 x 256-token batches.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from labkit.compress.distill import DistillConfig, distill
from labkit.compress.prune import (
    decoder_linear_params,
    ffn_fraction_for,
    importance,
    prune_structured,
    reconstruct,
)
from labkit.train.trainer import TrainConfig


@dataclass
class PruneRecipe:
    sparsity: float = 0.25  # of the decoder's linear weights
    head_fraction: float = 0.25  # of the query heads in every KV group
    importance: str = "activation"
    calib_windows: int = 128  # x calib_len train tokens for importance and the refit
    calib_len: int = 256
    heal_steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    warmup_steps: int = 20
    temperature: float = 1.0
    seed: int = 0


def prune_and_refit(dense: nn.Module, calib: torch.Tensor, recipe: PruneRecipe,
                    scores: dict | None = None) -> tuple[nn.Module, dict]:
    """The pruned, refit model and what was removed (counts, the sparsity they make and the
    model before the refit, ``"one_shot"``). ``scores``: importance already computed with
    ``recipe.importance`` on ``calib[:32]`` (the first 32 windows are plenty for a ranking)."""
    cfg = dense.config
    ffn = ffn_fraction_for(cfg, recipe.sparsity, recipe.head_fraction)
    if scores is None:
        scores = importance(copy.deepcopy(dense), calib[:32], recipe.importance)
    pruned = prune_structured(dense, scores, recipe.head_fraction, ffn)
    one_shot = copy.deepcopy(pruned)
    reconstruct(pruned, dense, calib)
    pc = pruned.config
    info = {"query_heads": [cfg.num_attention_heads, pc.num_attention_heads],
            "ffn_channels": [cfg.intermediate_size, pc.intermediate_size],
            "decoder_sparsity": 1 - decoder_linear_params(pc) / decoder_linear_params(cfg),
            "parameters": [sum(p.numel() for p in m.parameters()) for m in (dense, pruned)]}
    info["parameter_reduction"] = 1 - info["parameters"][1] / info["parameters"][0]
    # transformers' LlamaConfig insists on hidden_size == heads x head_dim (labkit does not)
    info["hf_incompatible"] = pc.hidden_size != pc.num_attention_heads * pc.head_dim
    return pruned, {**info, "one_shot": one_shot}


def heal(student: nn.Module, teacher: nn.Module, train_ids: torch.Tensor, recipe: PruneRecipe,
         metrics: Callable[[nn.Module], dict], time_budget_s: float | None = None,
         eval_every: int = 25, on_eval: Callable[[dict], None] | None = None,
         progress: bool = True, after_step: Callable[[nn.Module], None] | None = None,
         device: str = "cpu") -> tuple[nn.Module, list[dict]]:
    """Distill ``teacher`` into ``student`` for ``recipe.heal_steps``; every ``eval_every`` steps
    ``metrics(student)`` (e.g. held-out perplexity and KL) joins the curve and ``on_eval`` sees
    the row (a checkpoint hook); ``after_step`` runs after every optimizer step (masked patterns
    re-apply their masks there). Returns (student, curve)."""
    cfg = TrainConfig(seq_len=recipe.seq_len, batch_size=recipe.batch_size,
                      max_steps=recipe.heal_steps, time_budget_s=time_budget_s, lr=recipe.lr,
                      warmup_steps=recipe.warmup_steps, eval_every=eval_every,
                      eval_max_tokens=recipe.seq_len, weight_decay=0.0, seed=recipe.seed,
                      log_every=max(1, min(eval_every, 10)), device=device)
    curve: list[dict] = []

    def record(row: dict) -> None:
        was = student.training
        student.eval()
        curve.append({"step": row["step"], "tokens": row["tokens_seen"],
                      "elapsed_s": row["elapsed_s"], **metrics(student)})
        student.train(was)
        if on_eval is not None:
            on_eval(curve[-1])

    held = train_ids[:recipe.seq_len + 1]  # distill's own held-out loss: one cheap window
    student, _ = distill(student, teacher, cfg, DistillConfig(recipe.temperature), train_ids,
                         held, progress=progress, on_eval=record,
                         after_step=after_step)
    return student.eval(), curve


def power_law_tokens(curve: list[dict], target_ppl: float, floor_ppl: float
                     ) -> float | None:
    """Tokens at which a power law ``ppl - floor = a * tokens^-b`` fitted (log-log least
    squares) to the second half of ``curve`` reaches ``target_ppl``; None if it never does.

    An honest extrapolation, not a promise: the excess over the dense model shrinks like a power
    of the tokens in the measured range, and nothing says it keeps doing so."""
    pts = [(r["tokens"], r["perplexity"] - floor_ppl) for r in curve if r["tokens"] > 0]
    pts = [(t, e) for t, e in pts[len(pts) // 2:] if e > 0]
    if len(pts) < 3 or target_ppl <= floor_ppl:
        return None
    x = torch.tensor([math.log(t) for t, _ in pts], dtype=torch.float64)
    y = torch.tensor([math.log(e) for _, e in pts], dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean())**2).sum())
    if slope >= 0:
        return None
    intercept = float(y.mean() - slope * x.mean())
    return math.exp((math.log(target_ppl - floor_ppl) - intercept) / slope)
