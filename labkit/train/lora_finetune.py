"""LoRA and QLoRA fine-tuning of a labkit model: the base frozen, only ``A`` and ``B`` learn.

LoRA (Hu et al., 2021) adds to a frozen projection ``W`` a low-rank update: the layer computes
``W x + (alpha / r) * B (A x)`` with ``A [r, in]``, ``B [out, r]``. Only ``A`` and ``B`` get
gradients and optimizer state (here ~200 k numbers against the base's 5 M), and ``B`` starts at
zero, so step 0 *is* the base model and training moves away from it only as far as the data
asks. Initialisation follows ``peft``: ``A`` Kaiming-uniform (``a = sqrt(5)``, bound
``1 / sqrt(in)``), ``B`` zero, so a saved adapter loads in ``peft`` as the same function.

QLoRA (Dettmers et al., 2023) keeps the frozen base in 4-bit NF4 (:mod:`labkit.quant.nf4`) and
de-quantizes each weight inside the forward (:class:`~labkit.quant.linear.NF4Linear` does
exactly that); gradients flow *through* the de-quantized weight into ``x`` and on to the
adapters, never into the codes, which are buffers and stay bit-identical. The adapter so learns
a correction for the NF4 base, not for the full-precision one: which is why serving it needs
care (:mod:`labkit.lora.merge`, ``labkit bench qlora``).

The loop reuses the pre-training recipe of :mod:`labkit.train.trainer` (seeded random windows,
warm-up then cosine, clipping, held-out loss over fixed windows), on the adapter's parameters
only.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.train.trainer import evaluate, lm_loss, lr_at, sample_batch

DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRATrainConfig:
    """What one fine-tuning run does (recorded in the adapter's card)."""

    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    steps: int = 150
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    batch_size: int = 8
    seq_len: int = 128
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_max_tokens: int | None = 16384
    log_every: int = 10
    seed: int = 0
    qlora: bool = False
    nf4_blocksize: int = 64
    extra: dict = field(default_factory=dict)  # free-form notes for the card (data, style)

    def __post_init__(self) -> None:
        for name in ("r", "steps", "batch_size", "seq_len", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.alpha <= 0 or self.lr <= 0:
            raise ValueError(f"alpha and lr must be positive, got {self.alpha}, {self.lr}")
        self.target_modules = tuple(self.target_modules)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoRATrainLinear(nn.Module):
    """A frozen base projection plus one trainable adapter: ``base(x) + s * B(A x)``, the same
    arithmetic as ``peft``'s ``lora.Linear`` (no dropout: the runs are short and seeded)."""

    def __init__(self, base: nn.Module, r: int, scaling: float, gen: torch.Generator) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling = scaling
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), as peft
        a = (torch.rand(r, self.in_features, generator=gen) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scaling


def attach_lora(model: nn.Module, cfg: LoRATrainConfig) -> dict[str, LoRATrainLinear]:
    """Freeze ``model`` and wrap every targeted projection (nn.Linear or a quantized layer) in
    a :class:`LoRATrainLinear`; returns them by module path (PEFT's names)."""
    from labkit.lora.adapter import SUPPORTED_MODULES

    bad = sorted(set(cfg.target_modules) - set(SUPPORTED_MODULES))
    if bad:
        raise ValueError(f"target modules {bad} are not LoRA targets labkit serves "
                         f"({list(SUPPORTED_MODULES)})")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    found = [(n, m) for n, m in model.named_modules()
             if n.rsplit(".", 1)[-1] in cfg.target_modules and hasattr(m, "in_features")]
    if not found:
        raise ValueError(f"the model has none of {list(cfg.target_modules)}")
    wrapped = {}
    for name, m in found:
        parent, _, attr = name.rpartition(".")
        w = LoRATrainLinear(m, cfg.r, cfg.scaling, gen)
        setattr(model.get_submodule(parent), attr, w)
        wrapped[name] = w
    return wrapped


def adapter_weights(layers: dict[str, LoRATrainLinear]) -> dict[str, tuple[torch.Tensor,
                                                                           torch.Tensor]]:
    """``{module path: (A, B)}`` detached float32 copies, what the PEFT writer takes."""
    return {n: (m.lora_A.detach().float().clone(), m.lora_B.detach().float().clone())
            for n, m in layers.items()}


def prepare_base(model: nn.Module, cfg: LoRATrainConfig) -> nn.Module:
    """The frozen base the adapter trains on: as loaded (LoRA), or its decoder linears swapped
    for NF4 (QLoRA; embeddings, norms and lm_head stay in full precision, as in QLoRA)."""
    if cfg.qlora:
        from labkit.quant.model import quantize_model

        model = quantize_model(model, "nf4", blocksize=cfg.nf4_blocksize, inplace=True)
    return model


def finetune_lora(model: nn.Module, cfg: LoRATrainConfig, train_ids: torch.Tensor,
                  heldout_ids: torch.Tensor, progress: bool = True
                  ) -> tuple[dict[str, LoRATrainLinear], dict]:
    """Train an adapter on ``model`` (already :func:`prepare_base`'d) over the id streams.
    Returns the wrapped layers and the log (train loss every ``log_every`` steps, held-out
    loss at step 0, every ``eval_every`` steps and at the end)."""
    if train_ids.numel() <= cfg.seq_len + 1:
        raise ValueError(f"train stream has {train_ids.numel()} tokens, fewer than one window "
                         f"of seq_len {cfg.seq_len}")
    torch.manual_seed(cfg.seed)
    layers = attach_lora(model, cfg)
    params = [p for m in layers.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    log = {"train": [], "eval": [], "config": asdict(cfg),
           "trainable_parameters": sum(p.numel() for p in params),
           "train_tokens": train_ids.numel(), "heldout_tokens": heldout_ids.numel()}

    def run_eval(step: int) -> None:
        loss = evaluate(model, heldout_ids, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
        log["eval"].append({"step": step, "heldout_loss": loss})

    t0 = time.perf_counter()
    model.train()
    run_eval(0)
    running, n = 0.0, 0
    bar = tqdm(range(cfg.steps), desc="finetune" + (" (qlora)" if cfg.qlora else ""),
               unit="step", disable=not progress, dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, cfg.steps)
        x, y = sample_batch(train_ids, cfg, gen)
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        running, n = running + loss.item(), n + 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            log["train"].append({"step": step + 1, "loss": running / n})
            bar.set_postfix(loss=f"{running / n:.3f}")
            running, n = 0.0, 0
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            run_eval(step + 1)
    model.eval()
    log["wall_time_s"] = time.perf_counter() - t0
    return layers, log


@torch.no_grad()
def load_adapter_layers(model: nn.Module, adapter: str) -> dict[str, LoRATrainLinear]:
    """Wrap ``model`` with a saved PEFT adapter's ``A``, ``B`` and scaling: the unmerged
    forward ``base(x) + s B(A x)`` exactly as training ran it (over whatever base ``model``
    is: full precision or NF4), for evaluating an adapter outside the engine."""
    from labkit.lora.adapter import SUPPORTED_MODULES, load_adapter, read_adapter_config

    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if hasattr(m, "in_features") and n.rsplit(".", 1)[-1] in SUPPORTED_MODULES}
    lm = load_adapter(0, adapter, shapes, max_lora_rank=1 << 30)
    cfg_json = read_adapter_config(Path(adapter))
    targets = tuple(sorted({n.rsplit(".", 1)[-1] for n in lm.weights}))
    cfg = LoRATrainConfig(r=lm.rank, alpha=float(cfg_json["lora_alpha"]), target_modules=targets)
    layers = attach_lora(model, cfg)
    for name, m in layers.items():
        a, b = lm.weights[name]
        m.lora_A.copy_(a)
        m.lora_B.copy_(b)
        m.scaling = lm.scaling
    return layers
