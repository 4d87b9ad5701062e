"""Pre-training loop for labkit's own `LlamaForCausalLM`: the textbook recipe, small enough to read.

* Batches are random windows of ``seq_len + 1`` tokens cut from the train id stream; the start
  offsets come from one seeded CPU `torch.Generator`, so a run is reproducible and a resumed run
  draws exactly the batches the uninterrupted run would have drawn.
* AdamW (no weight decay on norms), linear warmup then cosine decay to ``min_lr_ratio * lr``,
  gradient clipping, bf16 autocast on CUDA (weights and optimizer state stay float32).
* Held-out loss every ``eval_every`` steps over non-overlapping windows of the held-out stream.
* ``time_budget_s`` trains "as long as fits": it times a few warm-up steps and one evaluation, then
  fixes ``max_steps`` (logged, so the run can be repeated exactly with ``--max-steps``). The
  schedule only depends on ``max_steps`` after warm-up, so fixing it mid-warm-up changes nothing.
* A mixture of experts adds ``aux_loss_coef * balance + z_loss_coef * z`` (:mod:`moe_loss`)
  from the router logits of the same forward; both are logged beside the loss.
* A checkpoint (model, optimizer, generator state, log) is written atomically every
  ``checkpoint_every`` steps and at the end; ``resume=True`` continues from it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.train.moe_loss import moe_aux_losses


@dataclass
class TrainConfig:
    seq_len: int = 1024
    batch_size: int = 64
    max_steps: int | None = None
    time_budget_s: float | None = None  # resolve max_steps from measured step time
    max_epochs: float | None = None  # cap max_steps at this many passes over the train stream
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_max_tokens: int | None = None  # None: the whole held-out stream
    log_every: int = 10
    checkpoint_every: int = 500
    stop_after: int | None = None  # stop (with a checkpoint) after this step; resume later
    seed: int = 0
    device: str = "cpu"
    aux_loss_coef: float = 0.0  # MoE load balancing (moe_loss.py); ignored for a dense model
    z_loss_coef: float = 0.0  # MoE router z-loss

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_budget_s is None:
            raise ValueError("give max_steps or time_budget_s (how long to train)")
        for name in ("seq_len", "batch_size", "eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


def lr_at(step: int, cfg: TrainConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, cosine decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    ratio = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * ratio


def init_weights(model: LlamaForCausalLM) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers) so the
    residual stream's variance does not grow with depth at initialisation."""
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(
                ("o_proj.weight", "down_proj.weight", "experts.down_proj")) else 0.02
            torch.nn.init.normal_(p, std=std)


def sample_batch(data: torch.Tensor, cfg: TrainConfig,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """B random windows: inputs data[s:s+T], targets data[s+1:s+T+1]."""
    starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(cfg.seq_len + 1)
    w = data[idx.to(data.device)]
    return w[:, :-1], w[:, 1:]


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lm_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy, computed in float32."""
    with _autocast(x.device):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, heldout: torch.Tensor, seq_len: int, batch_size: int,
             max_tokens: int | None = None) -> float:
    """Mean loss per predicted token over non-overlapping held-out windows (each window starts
    fresh, so this is a slightly pessimistic but reproducible perplexity)."""
    n = heldout.numel() - 1 if max_tokens is None else min(max_tokens, heldout.numel() - 1)
    if n < 1:
        raise ValueError("held-out stream is empty; the corpus selection has no held-out files")
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=heldout.device), 0
    full = n // seq_len
    windows = [(s, seq_len) for s in range(0, full * seq_len, seq_len)]
    batches = [windows[i:i + batch_size] for i in range(0, full, batch_size)]
    if n % seq_len:
        batches.append([(full * seq_len, n % seq_len)])  # the short tail, alone
    for batch in batches:
        length = batch[0][1]
        idx = torch.tensor([s for s, _ in batch])[:, None] + torch.arange(length + 1)
        w = heldout[idx.to(heldout.device)]
        total += lm_loss(model, w[:, :-1], w[:, 1:], reduction="sum").double()
        count += w[:, 1:].numel()
    model.train(was_training)
    return float(total) / count


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: an interrupted save never leaves a half-written checkpoint


def train(model_config: ModelConfig, cfg: TrainConfig, train_ids: torch.Tensor,
          heldout_ids: torch.Tensor, checkpoint_path: str | Path,
          resume: bool = False) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh (or resumed) model; returns it with the run log (steps, losses, timings)."""
    device = torch.device(cfg.device)
    if train_ids.numel() <= cfg.seq_len + 1:
        raise ValueError(f"train stream has {train_ids.numel()} tokens, fewer than one window "
                         f"of seq_len {cfg.seq_len}")
    if cfg.seq_len > model_config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's context "
                         f"{model_config.max_position_embeddings}")
    if int(train_ids.max()) >= model_config.vocab_size:
        raise ValueError("token ids exceed the model's vocab_size; tokenizer and model disagree")
    checkpoint_path = Path(checkpoint_path)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(model_config)
    init_weights(model)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed)
    step, max_steps = 0, cfg.max_steps
    log = {"train": [], "eval": [], "train_config": asdict(cfg),
           "model_config": model_config.to_hf_dict(),
           "num_parameters": model_config.num_parameters(), "train_tokens": train_ids.numel(),
           "heldout_tokens": heldout_ids.numel(), "wall_time_s": 0.0, "resumed_at": []}
    if resume and checkpoint_path.is_file():
        state = torch.load(checkpoint_path, map_location=device, weights_only=False)
        if state["model_config"] != model_config.to_hf_dict():
            raise ValueError(f"checkpoint {checkpoint_path} is for a different model config")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, max_steps, log = state["step"], state["max_steps"], state["log"]
        log["resumed_at"].append(step)
    train_ids, heldout_ids = train_ids.to(device), heldout_ids.to(device)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def checkpoint() -> None:
        _save_checkpoint(checkpoint_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "generator": gen.get_state(), "step": step, "max_steps": max_steps, "log": log,
            "model_config": model_config.to_hf_dict()})

    def run_eval() -> float:
        t = time.perf_counter()
        loss = evaluate(model, heldout_ids, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
        log["eval"].append({"step": step, "heldout_loss": loss,
                            "tokens_seen": step * tokens_per_step})
        return time.perf_counter() - t

    t_start = time.perf_counter() - log["wall_time_s"]
    if step == 0:
        run_eval()
    # max_steps from the time budget: time `calib` warm steps (and a warm evaluation), before
    # warm-up ends when warmup_steps >= 4, so the cosine schedule is the same as with --max-steps.
    calib, t_calib, calib_from = max(1, min(10, cfg.warmup_steps - 3)), None, 0
    bar = tqdm(total=max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    running, n_running = torch.zeros((), device=device), 0
    aux_running = torch.zeros(2, device=device)
    while max_steps is None or step < max_steps:
        if max_steps is None and t_calib is None and step >= 3:
            _sync(device)
            t_calib, calib_from = time.perf_counter(), step
        elif max_steps is None and t_calib is not None and step - calib_from == calib:
            _sync(device)
            step_s = (time.perf_counter() - t_calib) / calib
            eval_s = run_eval()
            left = cfg.time_budget_s - (time.perf_counter() - t_start)
            max_steps = step + max(1, int(left / (step_s + eval_s / cfg.eval_every)))
            if cfg.max_epochs is not None:
                cap = int(cfg.max_epochs * train_ids.numel() / tokens_per_step)
                max_steps = max(step + 1, min(max_steps, cap))
            log["resolved_max_steps"] = {"max_steps": max_steps, "at_step": step,
                                         "step_s": step_s, "eval_s": eval_s}
            bar.total = max_steps
            bar.refresh()
        lr = lr_at(step, cfg, max_steps or 10**9)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sample_batch(train_ids, cfg, gen)
        loss = lm_loss(model, x, y)
        aux = moe_aux_losses(model)
        total = loss
        if aux:
            total = loss + cfg.aux_loss_coef * aux["balance"] + cfg.z_loss_coef * aux["z"]
            aux_running += torch.stack([aux["balance"].detach(), aux["z"].detach()])
        opt.zero_grad(set_to_none=True)
        total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running += loss.detach()
        n_running += 1
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == max_steps:
            mean = float(running) / n_running
            entry = {"step": step, "loss": mean, "lr": lr, "grad_norm": float(gnorm),
                     "tokens_seen": step * tokens_per_step,
                     "elapsed_s": time.perf_counter() - t_start}
            if aux:
                entry["balance_loss"], entry["z_loss"] = (aux_running / n_running).tolist()
            log["train"].append(entry)
            running.zero_()
            aux_running.zero_()
            n_running = 0
            bar.set_postfix(loss=f"{mean:.3f}", lr=f"{lr:.2e}")
        if step % cfg.eval_every == 0 or step == max_steps:
            run_eval()
            bar.set_postfix(heldout=f"{log['eval'][-1]['heldout_loss']:.3f}")
        log["wall_time_s"] = time.perf_counter() - t_start
        if step == max_steps or step % cfg.checkpoint_every == 0 or step == cfg.stop_after:
            checkpoint()
        if step == cfg.stop_after:
            break
    bar.close()
    log["steps"] = step
    log["max_steps"] = max_steps
    log["tokens_seen"] = step * tokens_per_step
    log["finished"] = step == max_steps
    return model, log
