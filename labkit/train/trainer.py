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


@dataclass
class _Run:
    """A run's state: what a checkpoint saves (with the model config) and resuming restores."""
    model: LlamaForCausalLM
    opt: torch.optim.Optimizer
    gen: torch.Generator
    log: dict
    step: int = 0
    max_steps: int | None = None


def _check_inputs(model_config: ModelConfig, cfg: TrainConfig, train_ids: torch.Tensor) -> None:
    """Refuse a stream the model cannot train on before any weight is built."""
    if train_ids.numel() <= cfg.seq_len + 1:
        raise ValueError(f"train stream has {train_ids.numel()} tokens, fewer than one window "
                         f"of seq_len {cfg.seq_len}")
    if cfg.seq_len > model_config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's context "
                         f"{model_config.max_position_embeddings}")
    if int(train_ids.max()) >= model_config.vocab_size:
        raise ValueError("token ids exceed the model's vocab_size; tokenizer and model disagree")


def _new_run(model_config: ModelConfig, cfg: TrainConfig, train_ids: torch.Tensor,
             heldout_ids: torch.Tensor, device: torch.device) -> _Run:
    """Seeded weights, AdamW (no decay on norms and biases) and the batch generator, in the
    order the seed is drawn from, so the same seed gives the same model."""
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
    log = {"train": [], "eval": [], "train_config": asdict(cfg),
           "model_config": model_config.to_hf_dict(),
           "num_parameters": model_config.num_parameters(), "train_tokens": train_ids.numel(),
           "heldout_tokens": heldout_ids.numel(), "wall_time_s": 0.0, "resumed_at": []}
    return _Run(model, opt, gen, log, 0, cfg.max_steps)


def _resume(run: _Run, path: Path, model_config: ModelConfig, device: torch.device) -> None:
    """Continue from the checkpoint: same weights, optimizer moments and batch stream."""
    state = torch.load(path, map_location=device, weights_only=False)
    if state["model_config"] != model_config.to_hf_dict():
        raise ValueError(f"checkpoint {path} is for a different model config")
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    run.gen.set_state(state["generator"])
    run.step, run.max_steps, run.log = state["step"], state["max_steps"], state["log"]
    run.log["resumed_at"].append(run.step)


def _checkpoint(path: Path, run: _Run, model_config: ModelConfig) -> None:
    """Everything :func:`_resume` needs to draw the batches the uninterrupted run would."""
    _save_checkpoint(path, {
        "model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
        "generator": run.gen.get_state(), "step": run.step, "max_steps": run.max_steps,
        "log": run.log, "model_config": model_config.to_hf_dict()})


def _run_eval(run: _Run, cfg: TrainConfig, heldout_ids: torch.Tensor) -> float:
    """Log the held-out loss at this step; returns its seconds (the time budget counts them)."""
    t = time.perf_counter()
    loss = evaluate(run.model, heldout_ids, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
    run.log["eval"].append({"step": run.step, "heldout_loss": loss,
                            "tokens_seen": run.step * (cfg.batch_size * cfg.seq_len)})
    return time.perf_counter() - t


def _resolve_max_steps(run: _Run, cfg: TrainConfig, step_s: float, heldout_ids: torch.Tensor,
                       train_tokens: int, t_start: float) -> None:
    """Fix max_steps so the steps left, with their share of evaluations, fill the time budget
    (capped at max_epochs); logged, so ``--max-steps`` repeats the run exactly."""
    eval_s = _run_eval(run, cfg, heldout_ids)
    left = cfg.time_budget_s - (time.perf_counter() - t_start)
    max_steps = run.step + max(1, int(left / (step_s + eval_s / cfg.eval_every)))
    if cfg.max_epochs is not None:
        cap = int(cfg.max_epochs * train_tokens / (cfg.batch_size * cfg.seq_len))
        max_steps = max(run.step + 1, min(max_steps, cap))
    run.max_steps = max_steps
    run.log["resolved_max_steps"] = {"max_steps": max_steps, "at_step": run.step,
                                     "step_s": step_s, "eval_s": eval_s}


def _optimizer_step(run: _Run, cfg: TrainConfig, train_ids: torch.Tensor, lr: float,
                    aux_running: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """One AdamW step on a fresh batch: LM loss (+ the MoE auxiliary losses, summed into
    ``aux_running``), clipped gradients; returns (LM loss, aux losses, gradient norm)."""
    for g in run.opt.param_groups:
        g["lr"] = lr
    x, y = sample_batch(train_ids, cfg, run.gen)
    loss = lm_loss(run.model, x, y)
    aux = moe_aux_losses(run.model)
    total = loss
    if aux:
        total = loss + cfg.aux_loss_coef * aux["balance"] + cfg.z_loss_coef * aux["z"]
        aux_running += torch.stack([aux["balance"].detach(), aux["z"].detach()])
    run.opt.zero_grad(set_to_none=True)
    total.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.opt.step()
    return loss, aux, gnorm


def _log_train(run: _Run, cfg: TrainConfig, lr: float, gnorm: torch.Tensor, aux: dict,
               running: torch.Tensor, aux_running: torch.Tensor, n_running: int,
               t_start: float) -> float:
    """Append the mean losses since the last entry and zero the sums (they stay on the device
    between entries: one sync per log line, not per step); returns the mean loss."""
    mean = float(running) / n_running
    entry = {"step": run.step, "loss": mean, "lr": lr, "grad_norm": float(gnorm),
             "tokens_seen": run.step * (cfg.batch_size * cfg.seq_len),
             "elapsed_s": time.perf_counter() - t_start}
    if aux:
        entry["balance_loss"], entry["z_loss"] = (aux_running / n_running).tolist()
    run.log["train"].append(entry)
    running.zero_()
    aux_running.zero_()
    return mean


def train(model_config: ModelConfig, cfg: TrainConfig, train_ids: torch.Tensor,
          heldout_ids: torch.Tensor, checkpoint_path: str | Path,
          resume: bool = False) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh (or resumed) model; returns it with the run log (steps, losses, timings)."""
    device = torch.device(cfg.device)
    _check_inputs(model_config, cfg, train_ids)
    checkpoint_path = Path(checkpoint_path)
    run = _new_run(model_config, cfg, train_ids, heldout_ids, device)
    if resume and checkpoint_path.is_file():
        _resume(run, checkpoint_path, model_config, device)
    train_ids, heldout_ids = train_ids.to(device), heldout_ids.to(device)
    t_start = time.perf_counter() - run.log["wall_time_s"]
    if run.step == 0:
        _run_eval(run, cfg, heldout_ids)
    # max_steps from the time budget: time `calib` warm steps (and a warm evaluation), before
    # warm-up ends when warmup_steps >= 4, so the cosine schedule is the same as with --max-steps.
    calib, t_calib, calib_from = max(1, min(10, cfg.warmup_steps - 3)), None, 0
    bar = tqdm(total=run.max_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True)
    running, n_running = torch.zeros((), device=device), 0
    aux_running = torch.zeros(2, device=device)
    while run.max_steps is None or run.step < run.max_steps:
        if run.max_steps is None and t_calib is None and run.step >= 3:
            _sync(device)
            t_calib, calib_from = time.perf_counter(), run.step
        elif run.max_steps is None and t_calib is not None and run.step - calib_from == calib:
            _sync(device)
            step_s = (time.perf_counter() - t_calib) / calib
            _resolve_max_steps(run, cfg, step_s, heldout_ids, train_ids.numel(), t_start)
            bar.total = run.max_steps
            bar.refresh()
        lr = lr_at(run.step, cfg, run.max_steps or 10**9)
        loss, aux, gnorm = _optimizer_step(run, cfg, train_ids, lr, aux_running)
        running += loss.detach()
        n_running += 1
        run.step += 1
        bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == run.max_steps:
            mean = _log_train(run, cfg, lr, gnorm, aux, running, aux_running, n_running, t_start)
            n_running = 0
            bar.set_postfix(loss=f"{mean:.3f}", lr=f"{lr:.2e}")
        if run.step % cfg.eval_every == 0 or run.step == run.max_steps:
            _run_eval(run, cfg, heldout_ids)
            bar.set_postfix(heldout=f"{run.log['eval'][-1]['heldout_loss']:.3f}")
        run.log["wall_time_s"] = time.perf_counter() - t_start
        if run.step in (run.max_steps, cfg.stop_after) or run.step % cfg.checkpoint_every == 0:
            _checkpoint(checkpoint_path, run, model_config)
        if run.step == cfg.stop_after:
            break
    bar.close()
    return run.model, _finish_log(run, cfg)


def _finish_log(run: _Run, cfg: TrainConfig) -> dict:
    """The run's totals, and whether it reached max_steps (False: stopped, resume later)."""
    run.log["steps"] = run.step
    run.log["max_steps"] = run.max_steps
    run.log["tokens_seen"] = run.step * (cfg.batch_size * cfg.seq_len)
    run.log["finished"] = run.step == run.max_steps
    return run.log
