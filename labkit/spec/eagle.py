"""An EAGLE draft head: draft from the target's own last hidden state (Li et al. 2024).

A separate draft model must re-derive, from tokens alone, everything the target already knows
about the context; a 1 M-parameter draft agrees with a 5 M target about 2/3 of the time. EAGLE
instead feeds the draft the target's *feature* (the last decoder layer's output, before the
final norm): at position p the head takes ``(embed(t_p), f_{p-1})`` -- the token the target
just chose and the feature that chose it -- through one linear layer and ONE decoder layer, and
predicts ``f̂_p``; the target's own final norm and LM head turn that into the next token. The
head owns only ``fc`` and one decoder layer (its embedding, norm and LM head are the target's,
shared, never copied), so it is about as cheap as one target layer.

Drafting γ tokens: step 1 feeds the positions the head has not seen with the target's verified
features; each later step feeds the previous draft token with the head's own predicted feature
(the target has not run on drafts yet). So the head's KV is valid only up to the last verified
token: positions fed predicted features are recomputed with true ones the next time.

This module holds the head, its training (distillation from the target's features and logits on
the target's own text) and save/load; :mod:`labkit.spec.eagle_proposer` runs it in the engine.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from labkit.model.llama import DecoderLayer, rope_cos_sin
from labkit.model.moe import refuse_moe

ARCHITECTURE = "LabkitEagleHead"


class EagleDraft(nn.Module):
    """The trainable head (``fc``, ``layer``) plus the target's embedding, final norm and LM head
    (kept in a tuple, not as submodules: they are the target's, not saved with the head).

    ``forward(input_ids, positions, kv_cache, logits_indices, features)`` has the model
    signature the engine's ModelRunner calls, plus ``features`` [1, T, d] (f_{p-1} for each
    token); it returns logits and leaves the predicted features of the same rows in
    ``last_hidden`` (the next draft step's input)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        tc = target.config
        refuse_moe(tc, "an EAGLE head (EagleDraft copies the target's layer layout)")
        # one layer, of the kind the target's last layer is (it continues from its features)
        last = None if tc.layer_types is None else tc.layer_types[-1:]
        self.config = replace(tc, num_hidden_layers=1, layer_types=last)
        d = tc.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        self.shared = (target.model.embed_tokens, target.model.norm, target.lm_head)
        self.last_hidden: torch.Tensor | None = None
        with torch.no_grad():  # start as "pass the feature through": f̂_p = f_{p-1}
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
        self.to(device=target.device, dtype=target.dtype)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def hidden(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               kv_cache=None) -> torch.Tensor:
        """f̂ [B, T, d] from tokens [B, T] and the features f_{p-1} [B, T, d] beside them."""
        embed = self.shared[0]
        x = self.fc(torch.cat([embed(input_ids), features.to(self.dtype)], dim=-1))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta,
                                x.dtype)
        return self.layer(x, cos, sin, positions, kv_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        _, norm, lm_head = self.shared
        return lm_head(norm(hidden))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache=None, logits_indices: torch.Tensor | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if features is None:
            raise ValueError("an EAGLE head needs the target's features beside the tokens")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        h = self.hidden(input_ids, features, positions, kv_cache)
        if logits_indices is not None:
            h = h.reshape(B * T, -1)[logits_indices]
        self.last_hidden = h
        return self.logits(h)


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, features) of the target on ``input_ids`` [B, T]: features are the input of the
    final norm (the last decoder layer's output), caught by a forward hook."""
    caught: list[torch.Tensor] = []
    hook = target.model.norm.register_forward_hook(lambda m, a, out: caught.append(a[0]))
    try:
        logits = target(input_ids)
    finally:
        hook.remove()
    return logits, caught[0]


def shifted_inputs(ids: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head inputs for positions 1..T-1: tokens t_p and features f_{p-1}."""
    return ids[:, 1:], feats[:, :-1]


def eagle_loss(draft: EagleDraft, ids: torch.Tensor, feats: torch.Tensor,
               t_logits: torch.Tensor, reg_weight: float = 1.0, noise: float = 0.0,
               gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 agreement): forward KL of the head's next-token distribution against the
    target's at positions 1..T-1, plus ``reg_weight`` x smooth-L1 between f̂_p and f_p (EAGLE's
    feature regression). ``noise`` adds uniform noise to the input features (EAGLE does, so
    the head tolerates its own imperfect features in later draft steps)."""
    x_ids, x_feats = shifted_inputs(ids, feats)
    if noise:
        x_feats = x_feats + noise * (2 * torch.rand(x_feats.shape, generator=gen) - 1)
    T = x_ids.shape[1]
    pos = torch.arange(1, T + 1).expand(x_ids.shape[0], T)
    h = draft.hidden(x_ids, x_feats, pos)
    s = F.log_softmax(draft.logits(h).float(), -1)
    t = F.log_softmax(t_logits[:, 1:].float(), -1)
    kl = (t.exp() * (t - s)).sum(-1).mean()
    reg = F.smooth_l1_loss(h.float(), feats[:, 1:].float())
    agree = (s.argmax(-1) == t.argmax(-1)).float().mean()
    return kl + reg_weight * reg, agree


@dataclass
class EagleTrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    reg_weight: float = 1.0
    noise: float = 0.05
    text_fraction: float = 0.75  # rows of each batch from the teacher text (rest: corpus)
    time_budget_s: float | None = None
    eval_every: int = 100
    seed: int = 0


def _lr(cfg: EagleTrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of ``cfg.lr``."""
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    return cfg.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / cfg.steps)))


def _batch(train_ids: torch.Tensor, text: torch.Tensor | None, n_corpus: int, n_text: int,
           length: int, gen: torch.Generator) -> torch.Tensor:
    """``n_corpus`` random corpus windows and ``n_text`` teacher-text rows of ``length``."""
    starts = torch.randint(0, train_ids.numel() - length, (n_corpus,), generator=gen)
    rows = [train_ids[starts[:, None] + torch.arange(length)]]
    if n_text:
        rows.append(text[torch.randint(0, text.shape[0], (n_text,), generator=gen)][:, :length])
    return torch.cat(rows)


@torch.no_grad()
def probe_agreement(target: nn.Module, draft: EagleDraft, probe: list[torch.Tensor]) -> float:
    """Mean first-draft top-1 agreement (true features) over the probe sequences."""
    agree = []
    for x in probe:
        t_logits, feats = target_features(target, x)
        agree.append(eagle_loss(draft, x, feats, t_logits)[1])
    return float(sum(agree) / len(agree))


def train_eagle(target: nn.Module, draft: EagleDraft, cfg: EagleTrainConfig,
                train_ids: torch.Tensor, text: torch.Tensor | None = None,
                probe: list[torch.Tensor] | None = None, progress: bool = True,
                on_eval: Callable[[dict], None] | None = None) -> dict:
    """Train the head in place, target frozen; returns the log. ``text`` [N, >= seq_len+1]
    (:func:`labkit.compress.spec_data.draft_training_text`) gives ``text_fraction`` of each
    batch, corpus windows the rest; ``probe`` rows (target greedy text) give α."""
    target.eval().requires_grad_(False)
    opt = torch.optim.AdamW(params := list(draft.parameters()), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_text = int(round(cfg.text_fraction * cfg.batch_size)) if text is not None else 0
    log: dict = {"config": asdict(cfg), "train": [], "eval": []}
    t0 = time.perf_counter()

    def run_eval(step: int) -> None:
        row = {"step": step, "elapsed_s": time.perf_counter() - t0,
               **({"top1_agreement": probe_agreement(target, draft, probe)} if probe else {})}
        log["eval"].append(row)
        if on_eval:
            on_eval(row)

    run_eval(0)
    bar = tqdm(total=cfg.steps, desc="eagle", unit="step", disable=not progress)
    step = 0
    budget = math.inf if cfg.time_budget_s is None else cfg.time_budget_s
    while step < cfg.steps and time.perf_counter() - t0 <= budget:
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        ids = _batch(train_ids, text, cfg.batch_size - n_text, n_text, cfg.seq_len + 1,
                     gen).to(draft.device)
        t_logits, feats = target_features(target, ids)
        loss, agree = eagle_loss(draft, ids, feats, t_logits, cfg.reg_weight, cfg.noise, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss, step = loss.detach(), step + 1
        bar.update(1)
        if step % 10 == 0:
            log["train"].append({"step": step, "loss": float(loss), "agree": float(agree)})
            bar.set_postfix(loss=f"{float(loss):.3f}", agree=f"{float(agree):.3f}")
        if step % cfg.eval_every == 0:
            run_eval(step)
    bar.close()
    if log["eval"][-1]["step"] != step:
        run_eval(step)
    log.update(steps=step, tokens_seen=step * cfg.batch_size * cfg.seq_len,
               wall_time_s=time.perf_counter() - t0)
    draft.eval()
    return log


def save_eagle(draft: EagleDraft, out: str | Path, target_name: str,
               extra: dict | None = None) -> Path:
    """``model.safetensors`` (the head's own weights, float16) and ``config.json``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    cfg = {"architectures": [ARCHITECTURE], "target": target_name,
           "hidden_size": draft.config.hidden_size, "num_hidden_layers": 1,
           "torch_dtype": "float16", **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def is_eagle_dir(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and ARCHITECTURE in json.loads(p.read_text()).get("architectures", [])


def load_eagle(path_or_name: str | Path, target: nn.Module) -> EagleDraft:
    """A saved head on top of ``target`` (whose width it must match)."""
    from safetensors.torch import load_file

    from labkit.model.loader import resolve_model_path

    path = Path(resolve_model_path(path_or_name))
    if not is_eagle_dir(path):
        raise ValueError(f"{path} is not an EAGLE head (config.json architectures lacks "
                         f"{ARCHITECTURE!r})")
    cfg = json.loads((path / "config.json").read_text())
    if cfg["hidden_size"] != target.config.hidden_size:
        raise ValueError(f"EAGLE head {path} is for hidden size {cfg['hidden_size']}, the "
                         f"target has {target.config.hidden_size}: train a head for this target")
    draft = EagleDraft(target)
    state = load_file(str(path / "model.safetensors"))
    draft.load_state_dict({k: v.to(draft.dtype) for k, v in state.items()})
    return draft.eval()
