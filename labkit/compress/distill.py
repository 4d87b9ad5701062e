"""Knowledge distillation: train a student to match a teacher's next-token distributions.

Hinton et al. (2015): soften both distributions with a temperature T, ``p = softmax(z_t / T)``,
``q = softmax(z_s / T)``, and minimise a KL divergence between them. The soft targets carry far
more signal per token than the one-hot label (which wrong tokens are *nearly* right), which is
what lets a small student learn quickly from a big teacher. The gradient of the softened loss
shrinks like 1/T², so the loss is multiplied by **T²** to keep its scale (and the balance with
the hard-label term) independent of T.

* **forward KL**, ``KL(p || q) = Σ p (log p - log q)``: mean-seeking; the student spreads mass
  over everything the teacher finds plausible (the classic choice, = cross-entropy to soft
  labels up to a constant).
* **reverse KL**, ``KL(q || p)``: mode-seeking; the student concentrates on the teacher's main
  mode (MiniLLM, Gu et al. 2023) — which is what a *speculative-decoding draft* is scored on:
  greedy acceptance only asks whether the student's top token is the teacher's.
* ``hard_weight`` mixes in the usual cross-entropy on the corpus's next token (or, with
  ``hard_label="teacher"``, on the teacher's argmax):
  ``loss = (1 - w) · T² · KL + w · CE``.

The teacher runs on the fly (no_grad, eval mode) on exactly the windows the student sees.
Batches, learning-rate schedule and held-out loss are labkit.train's, not re-implemented here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from labkit.train.trainer import TrainConfig, evaluate, lr_at, sample_batch

DIRECTIONS = ("forward", "reverse")
HARD_LABELS = ("data", "teacher")


@dataclass
class DistillConfig:
    temperature: float = 1.0
    direction: str = "forward"
    hard_weight: float = 0.0  # weight of the hard-label cross-entropy (0 = pure distillation)
    hard_label: str = "data"  # "data": the text's next token; "teacher": the teacher's argmax

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.hard_weight <= 1:
            raise ValueError(f"hard_weight must be in [0, 1], got {self.hard_weight}")
        if self.hard_label not in HARD_LABELS:
            raise ValueError(f"hard_label must be one of {HARD_LABELS}, got {self.hard_label!r}")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            temperature: float = 1.0, direction: str = "forward") -> torch.Tensor:
    """T² · KL between temperature-softened distributions, mean over positions.

    forward: KL(teacher || student); reverse: KL(student || teacher)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: same tokenizer/vocab needed")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    s = F.log_softmax(student_logits.float() / temperature, dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, -2)
    a, b = (t, s) if direction == "forward" else (s, t)
    kl = (a.exp() * (a - b)).sum(-1).mean()
    return kl * temperature**2


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 targets: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """(1 - w) · T² · KL + w · CE(student, next token). With ``hard_label="teacher"`` the
    hard label is the teacher's argmax: greedy acceptance asks exactly for that token, and on
    sampled text the data's next token is often not it."""
    kd = kd_loss(student_logits, teacher_logits, cfg.temperature, cfg.direction)
    if cfg.hard_weight == 0:
        return kd
    if cfg.hard_label == "teacher":
        targets = teacher_logits.argmax(-1)
    ce = F.cross_entropy(student_logits.float().flatten(0, 1), targets.flatten())
    return (1 - cfg.hard_weight) * kd + cfg.hard_weight * ce


@torch.no_grad()
def agreement(student: nn.Module, teacher: nn.Module, tokens: torch.Tensor,
              start: int = 0) -> dict[str, float]:
    """Top-1 agreement and forward KL (T = 1) of student vs teacher on ``tokens`` [B, T],
    over the positions predicting tokens ``start+1 ..`` (``start`` = prompt length - 1).

    On the teacher's own greedy continuations, top-1 agreement is exactly the per-token
    acceptance probability α of greedy speculative decoding with this student as the draft."""
    was = student.training
    student.eval()
    s, t = student(tokens)[:, start:-1].float(), teacher(tokens)[:, start:-1].float()
    student.train(was)
    return {"top1_agreement": float((s.argmax(-1) == t.argmax(-1)).float().mean()),
            "kl": float(kd_loss(s, t))}


def batched_greedy(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations of equal-length prompts [B, P] -> [B, P + new_tokens], all rows at
    once through the reference contiguous KV cache (one prefill, then one token per step)."""
    from labkit.compress.spec_data import batched_generate

    return batched_generate(model, prompts, new_tokens)


Probe = list[tuple[torch.Tensor, int]]


def greedy_continuations(teacher: nn.Module, prompts: list[list[int]], new_tokens: int
                         ) -> Probe:
    """[(prompt + the teacher's greedy continuation [1, P + new_tokens], P)] per prompt: the
    exact text a draft must agree with in greedy speculative decoding of these prompts."""
    return [(batched_greedy(teacher, torch.tensor([p]), new_tokens), len(p)) for p in prompts]


def probe_agreement(student: nn.Module, teacher: nn.Module, probe: Probe) -> dict[str, float]:
    """:func:`agreement` over every probe continuation (each has the same number of tokens)."""
    rows = [agreement(student, teacher, seq, p_len - 1) for seq, p_len in probe]
    return {k: sum(r[k] for r in rows) / len(rows) for k in ("top1_agreement", "kl")}


def teacher_text(teacher: nn.Module, train_ids: torch.Tensor, rows: int, length: int,
                 prompt_len: int = 16, batch: int = 64, seed: int = 0) -> torch.Tensor:
    """``rows`` sequences of ``length`` tokens: a random train-split prompt of ``prompt_len``
    tokens continued greedily by the teacher. Training on the teacher's own outputs
    (sequence-level KD, Kim & Rush 2016; on-policy data in DistillSpec, Zhou et al. 2023) is
    what a draft is scored on: agreement on the text the target generates."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.numel() - prompt_len, (rows,), generator=gen)
    prompts = train_ids[starts[:, None] + torch.arange(prompt_len)]
    out = [batched_greedy(teacher, prompts[i:i + batch], length - prompt_len)
           for i in tqdm(range(0, rows, batch), desc="teacher text", leave=False)]
    return torch.cat(out).cpu()


def _mixed_batch(train_ids: torch.Tensor, text: torch.Tensor | None, fraction: float,
                 cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Corpus windows, with ``fraction`` of the rows replaced by teacher-text rows."""
    x, y = sample_batch(train_ids, cfg, gen)
    n = int(round(fraction * cfg.batch_size)) if text is not None else 0
    if n:
        rows = text[torch.randint(0, text.shape[0], (n,), generator=gen)][:, :cfg.seq_len + 1]
        x, y = x.clone(), y.clone()
        x[:n], y[:n] = rows[:, :-1].to(x.device), rows[:, 1:].to(y.device)
    return x, y


def distill(student: nn.Module, teacher: nn.Module, cfg: TrainConfig, kd: DistillConfig,
            train_ids: torch.Tensor, heldout_ids: torch.Tensor,
            probe: Probe | None = None, progress: bool = True,
            on_eval: Callable[[dict], None] | None = None, text: torch.Tensor | None = None,
            text_fraction: float = 0.0,
            after_step: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, dict]:
    """Distill ``teacher`` into ``student`` (trained in place); returns (student, log).

    Every ``eval_every`` steps: the student's held-out loss and, on ``probe`` (e.g. teacher
    greedy continuations of the code prompts, from :func:`greedy_continuations`), top-1
    agreement and KL with the teacher. ``text`` [N, >= seq_len + 1] (from :func:`teacher_text`)
    replaces ``text_fraction`` of every batch's rows. ``after_step(student)`` runs after every
    optimizer step (pruning's healing re-applies its masks there).
    ``cfg.time_budget_s`` stops after that many seconds (the schedule then assumes max_steps).
    """
    opt = _setup(student, teacher, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    max_steps = cfg.max_steps or 10**9
    log: dict = {"train": [], "eval": [], "train_config": asdict(cfg), "distill": asdict(kd)}
    t0 = time.perf_counter()

    def run_eval(step: int) -> None:
        log["eval"].append(_eval_row(student, teacher, heldout_ids, probe, cfg, step, t0))
        if on_eval is not None:
            on_eval(log["eval"][-1])

    run_eval(0)
    bar = tqdm(total=cfg.max_steps, desc="distill", unit="step", disable=not progress)
    step, running = 0, 0.0
    while step < max_steps:
        if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, max_steps)
        x, y = _mixed_batch(train_ids, text, text_fraction, cfg, gen)
        loss = _distill_step(student, teacher, opt, x, y, kd, cfg.grad_clip, after_step)
        step += 1
        running += float(loss.detach())
        bar.update(1)
        if step % cfg.log_every == 0:
            _log_train(log, bar, step, running / cfg.log_every, t0)
            running = 0.0
        if step % cfg.eval_every == 0:
            run_eval(step)
    bar.close()
    if not log["eval"] or log["eval"][-1]["step"] != step:
        run_eval(step)
    student.eval()
    return student, _finish_log(log, step, cfg, t0)


def _setup(student: nn.Module, teacher: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Both models on the device (the teacher frozen in eval mode) and AdamW over the
    student's trainable parameters, without weight decay on norms and biases."""
    device = torch.device(cfg.device)
    teacher.to(device).eval()
    student.to(device).train()
    decay = [p for p in student.parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for p in student.parameters() if p.dim() < 2 and p.requires_grad]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=cfg.betas)


def _eval_row(student: nn.Module, teacher: nn.Module, heldout_ids: torch.Tensor,
              probe: Probe | None, cfg: TrainConfig, step: int, t0: float) -> dict:
    """The student's held-out loss at ``step`` and, with a probe, its top-1 agreement and KL
    with the teacher: the curve the card and ``on_eval`` show."""
    row = {"step": step, "tokens_seen": step * cfg.batch_size * cfg.seq_len,
           "elapsed_s": time.perf_counter() - t0,
           "heldout_loss": evaluate(student, heldout_ids, cfg.seq_len, cfg.batch_size,
                                    cfg.eval_max_tokens)}
    if probe is not None:
        device = torch.device(cfg.device)
        row.update(probe_agreement(student, teacher, [(x.to(device), n) for x, n in probe]))
    return row


def _distill_step(student: nn.Module, teacher: nn.Module, opt: torch.optim.Optimizer,
                  x: torch.Tensor, y: torch.Tensor, kd: DistillConfig, grad_clip: float,
                  after_step: Callable[[nn.Module], None] | None) -> torch.Tensor:
    """One optimizer step of the student towards the teacher's logits on the same windows
    (the teacher without gradients); returns the distillation loss."""
    with torch.no_grad():
        t_logits = teacher(x)
    loss = distill_loss(student(x), t_logits, y, kd)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), grad_clip)
    opt.step()
    if after_step is not None:
        after_step(student)
    return loss


def _log_train(log: dict, bar: tqdm, step: int, mean: float, t0: float) -> None:
    """Record the mean distillation loss since the last entry."""
    log["train"].append({"step": step, "loss": mean, "elapsed_s": time.perf_counter() - t0})
    bar.set_postfix(loss=f"{mean:.3f}")


def _finish_log(log: dict, step: int, cfg: TrainConfig, t0: float) -> dict:
    """The run's totals and the final held-out perplexity."""
    log.update(steps=step, tokens_seen=step * cfg.batch_size * cfg.seq_len,
               wall_time_s=time.perf_counter() - t0,
               heldout_perplexity=math.exp(log["eval"][-1]["heldout_loss"]))
    return log


def drop_layers(model: nn.Module, keep: list[int]) -> nn.Module:
    """A copy of ``model`` with only decoder layers ``keep`` (embeddings, final norm and
    lm_head shared in value): the cheap way to start a student that already speaks the
    teacher's embedding space (DistilBERT initialises from every other teacher layer)."""
    import copy
    from dataclasses import replace

    from labkit.model.llama import LlamaForCausalLM
    from labkit.model.moe import refuse_moe

    refuse_moe(model.config, "layer dropping (drop_layers)")  # MoE layer indices would shift
    n = model.config.num_hidden_layers
    if not keep or any(not 0 <= i < n for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"keep must be distinct layer indices in [0, {n}), got {keep}")
    types = model.config.layer_types  # each kept layer keeps its attention kind
    cfg = replace(model.config, num_hidden_layers=len(keep),
                  layer_types=None if types is None else [types[i] for i in keep])
    student = LlamaForCausalLM(cfg)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.")}
    for new, old in enumerate(keep):
        prefix = f"model.layers.{old}."
        state.update({f"model.layers.{new}.{k[len(prefix):]}": v
                      for k, v in model.state_dict().items() if k.startswith(prefix)})
    student.load_state_dict(copy.deepcopy(state))
    for i, layer in enumerate(student.model.layers):  # the attention's KV-cache slot
        layer.self_attn.layer_idx = i
    return student.to(next(model.parameters()).dtype)
