"""Pruning: remove (structured) or zero (unstructured, 2:4) weights, then heal by distillation.

* **Structured**: drop whole query heads and FFN channels. The result is a smaller *dense*
  model (a valid Llama config with fewer ``num_attention_heads`` and a smaller
  ``intermediate_size``), so it is faster everywhere with no special kernel. A config holds one
  head count and one FFN width for all layers, so every layer loses the same number of units
  (which ones differs per layer), and heads are removed evenly from every KV group (GQA repeats
  each KV head over a fixed number of query heads).
* **Unstructured magnitude**: zero the smallest |w| of every decoder linear. Dense kernels gain
  nothing; sparse storage would save bytes.
* **2:4 semi-structured**: in every 4 consecutive weights along the input dimension keep the 2
  largest |w|: the pattern NVIDIA's sparse tensor cores (Ampere+) run at up to 2x; on CPU it is
  just zeros.

Importance of a unit (head or channel), three ways:
  magnitude   the norms of the weights that write and read it (no data needed);
  activation  mean size of its output on calibration data times the norm of the weights that
              carry it to the residual stream (Wanda-like: weight x activation);
  gradient    first-order Taylor estimate of the loss change if it were removed,
              |Σ a · ∂L/∂a| over calibration tokens (Molchanov et al. 2019).

After structured pruning, :func:`reconstruct` refits the output projections by least squares
on calibration text (no training), then healing distils from the dense model.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.moe import refuse_moe

IMPORTANCE = ("magnitude", "activation", "gradient")


def _heads(layer: nn.Module, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: q_proj rows [H, D*hidden] and o_proj columns [H, hidden*D], flattened."""
    a = layer.self_attn
    d = a.head_dim
    q = a.q_proj.weight.detach().view(n_heads, d, -1).flatten(1)
    o = a.o_proj.weight.detach().view(a.o_proj.out_features, n_heads, d).transpose(0, 1)
    return q, o.flatten(1)


class _Recorder:
    """Inputs (and, for 'gradient', their gradients) of o_proj and down_proj in every layer."""

    def __init__(self, model: nn.Module, grads: bool) -> None:
        self.acts: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.grads: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            for kind, mod in (("attn", layer.self_attn.o_proj), ("ffn", layer.mlp.down_proj)):
                self.handles.append(mod.register_forward_pre_hook(
                    lambda _m, inp, key=(i, kind): self._hook(key, inp[0], grads)))

    def _hook(self, key, x, grads):
        self.acts.setdefault(key, []).append(x.detach())
        if grads and x.requires_grad:
            x.register_hook(lambda g: self.grads.setdefault(key, []).append(g.detach()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def importance(model: nn.Module, calib: torch.Tensor | None = None,
               method: str = "activation") -> dict[str, torch.Tensor]:
    """{"heads": [layers, num_heads], "channels": [layers, intermediate_size]} scores."""
    refuse_moe(model.config, "pruning (importance)")
    if method not in IMPORTANCE:
        raise ValueError(f"method must be one of {IMPORTANCE}, got {method!r}")
    cfg = model.config
    H, d = cfg.num_attention_heads, cfg.head_dim
    layers = model.model.layers
    if method == "magnitude":
        heads, chans = [], []
        for layer in layers:
            q, o = _heads(layer, H)
            heads.append(q.norm(dim=1) * o.norm(dim=1))
            m = layer.mlp
            chans.append(m.gate_proj.weight.norm(dim=1) * m.up_proj.weight.norm(dim=1) *
                         m.down_proj.weight.norm(dim=0))
        return {"heads": torch.stack(heads).detach(), "channels": torch.stack(chans).detach()}
    if calib is None:
        raise ValueError(f"importance {method!r} needs calibration tokens [batch, seq]")
    rec = _Recorder(model, grads=method == "gradient")
    try:
        if method == "gradient":
            model.zero_grad(set_to_none=True)
            logits = model(calib[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), calib[:, 1:].flatten()).backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                model(calib)
    finally:
        rec.close()
    heads, chans = [], []
    for i, layer in enumerate(layers):
        a_attn = torch.cat([a.reshape(-1, H, d) for a in rec.acts[(i, "attn")]])
        a_ffn = torch.cat([a.reshape(-1, a.shape[-1]) for a in rec.acts[(i, "ffn")]])
        if method == "activation":
            _, o = _heads(layer, H)
            heads.append(a_attn.norm(dim=-1).mean(0) * o.norm(dim=1))
            chans.append(a_ffn.abs().mean(0) * layer.mlp.down_proj.weight.detach().norm(dim=0))
        else:
            g_attn = torch.cat([g.reshape(-1, H, d) for g in rec.grads[(i, "attn")]])
            g_ffn = torch.cat([g.reshape(-1, g.shape[-1]) for g in rec.grads[(i, "ffn")]])
            heads.append((a_attn * g_attn).sum(-1).sum(0).abs())
            chans.append((a_ffn * g_ffn).sum(0).abs())
    return {"heads": torch.stack(heads), "channels": torch.stack(chans)}


def _keep_heads(scores: torch.Tensor, kv_heads: int, keep_per_group: int) -> torch.Tensor:
    """Indices of the kept query heads: the top ``keep_per_group`` of every KV group, in order."""
    rep = scores.numel() // kv_heads
    idx = [g * rep + scores[g * rep:(g + 1) * rep].topk(keep_per_group).indices.sort().values
           for g in range(kv_heads)]
    return torch.cat(idx)


@torch.no_grad()
def prune_structured(model: nn.Module, scores: dict[str, torch.Tensor], head_fraction: float,
                     ffn_fraction: float) -> nn.Module:
    """A new, smaller dense model: the least important ``head_fraction`` of query heads (evenly
    per KV group) and ``ffn_fraction`` of FFN channels removed in every layer."""
    refuse_moe(model.config, "pruning (prune_structured)")
    from labkit.model.llama import LlamaForCausalLM

    cfg = model.config
    kv, rep = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    keep_rep = rep - int(round(head_fraction * rep))
    keep_ffn = cfg.intermediate_size - int(round(ffn_fraction * cfg.intermediate_size))
    if keep_rep < 1 or keep_ffn < 1:
        raise ValueError("pruning would remove every head of a group or every FFN channel")
    new_cfg = replace(cfg, num_attention_heads=kv * keep_rep, intermediate_size=keep_ffn)
    new = LlamaForCausalLM(new_cfg).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items()}
    d = cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        heads = _keep_heads(scores["heads"][i], kv, keep_rep)
        rows = (heads[:, None] * d + torch.arange(d)).flatten()
        state[p + "self_attn.q_proj.weight"] = state[p + "self_attn.q_proj.weight"][rows]
        if p + "self_attn.q_proj.bias" in state:
            state[p + "self_attn.q_proj.bias"] = state[p + "self_attn.q_proj.bias"][rows]
        state[p + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"][:, rows]
        ch = scores["channels"][i].topk(keep_ffn).indices.sort().values
        for name in ("gate_proj", "up_proj"):
            state[p + f"mlp.{name}.weight"] = state[p + f"mlp.{name}.weight"][ch]
        state[p + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"][:, ch]
    new.load_state_dict({k: v.clone() for k, v in state.items()})
    return new.eval()


def decoder_linear_params(cfg) -> int:
    """Weights of the decoder's linear layers (q, k, v, o, gate, up, down in every layer): what
    "sparsity" counts here, as in SparseGPT / Wanda (embeddings, lm_head and norms excluded)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = 2 * h * d * (cfg.num_attention_heads + cfg.num_key_value_heads)
    return cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size)


def ffn_fraction_for(cfg, sparsity: float, head_fraction: float) -> float:
    """The FFN fraction that, with ``head_fraction`` of the query heads, removes ``sparsity`` of
    the decoder's linear weights (rounded to whole channels).

    Heads first, the rest from the FFN: Minitron (Muralidharan et al. 2024) finds width pruning
    of FFN neurons and heads best, and on labkit-tiny 1 head of 4 per KV group + FFN channels
    beats FFN alone and 2 heads per group at equal sparsity (see ``labkit bench compress``)."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = cfg.num_key_value_heads * int(round(head_fraction * rep))
    per_layer = sparsity * decoder_linear_params(cfg) / cfg.num_hidden_layers
    rest = per_layer - heads * 2 * cfg.hidden_size * cfg.head_dim
    channels = round(rest / (3 * cfg.hidden_size))
    if rest < 0 or channels >= cfg.intermediate_size:
        raise ValueError(f"head_fraction {head_fraction} with sparsity {sparsity} needs "
                         f"{channels} of {cfg.intermediate_size} FFN channels: choose fewer "
                         "heads or a lower sparsity")
    return channels / cfg.intermediate_size


# ---- one-shot repair: refit the output projections by least squares ------------------------
def _projections(model: nn.Module) -> list[nn.Linear]:
    return [m for layer in model.model.layers for m in (layer.self_attn.o_proj,
                                                         layer.mlp.down_proj)]


def _capture(model: nn.Module, modules: list[nn.Module], calib: torch.Tensor, outputs: bool,
             batch: int = 8) -> list[torch.Tensor]:
    """Inputs (or outputs) [tokens, features] of ``modules`` over ``calib``; the forward is cut
    after the last of them."""
    from labkit.quant.calib import run_to_layer

    got: list[list[torch.Tensor]] = [[] for _ in modules]
    hs = [m.register_forward_hook(lambda _m, inp, out, i=i: got[i].append(
        (out if outputs else inp[0]).flatten(0, -2))) for i, m in enumerate(modules)]
    try:
        run_to_layer(model, calib, modules[-1], batch)
    finally:
        for h in hs:
            h.remove()
    return [torch.cat(g).double() for g in got]


@torch.no_grad()
def reconstruct(pruned: nn.Module, dense: nn.Module, calib: torch.Tensor,
                damp: float = 1e-3) -> nn.Module:
    """Refit every ``o_proj`` and ``down_proj`` of ``pruned`` (in place) so that, on the pruned
    model's own inputs, it reproduces what the dense layer output: ridge least squares
    ``W = argmin ||X W^T - Y||^2 + damp * mean(diag X^T X) * ||W||^2``.

    Removing heads or channels deletes terms from a sum that lands in the residual stream; the
    surviving units are correlated with the removed ones, so re-weighting them recovers much of
    the lost signal with no training. Front to back, each fit sees the inputs that the
    already-repaired projections produce, so errors do not pile up (the layer-wise
    reconstruction of Kwon et al. 2022; SparseGPT's sequential pass)."""
    refuse_moe(pruned.config, "pruning (reconstruct)")
    need = 2 * max(m.in_features for m in _projections(pruned))
    if calib.numel() < need:
        raise ValueError(f"reconstruct needs at least {need} calibration tokens (twice the "
                         f"widest projection's inputs) for a well-posed fit, got "
                         f"{calib.numel()}: pass more or longer windows")
    targets = _capture(dense, _projections(dense), calib, outputs=True)
    for mod, y in zip(_projections(pruned), targets):
        x = _capture(pruned, [mod], calib, outputs=False)[0]
        g = x.T @ x
        g.diagonal().add_(damp * g.diagonal().mean())
        w = torch.linalg.solve(g, x.T @ (y if mod.bias is None else y - mod.bias.double()))
        mod.weight.copy_(w.T.to(mod.weight.dtype))
    return pruned


# ---- unstructured and 2:4: masks over the decoder linears ------------------------------------
def decoder_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> weight of every nn.Linear inside the decoder layers (not embeddings/lm_head)."""
    return {f"{n}.weight": m.weight for n, m in model.model.layers.named_modules()
            if isinstance(m, nn.Linear)}


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """True where kept: all but the ``sparsity`` fraction of smallest |w| of this matrix."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    k = int(sparsity * w.numel())
    if k == 0:
        return torch.ones_like(w, dtype=torch.bool)
    thresh = w.abs().flatten().kthvalue(k).values
    return w.abs() > thresh


def mask_2_4(w: torch.Tensor) -> torch.Tensor:
    """True where kept: the 2 largest |w| of every 4 consecutive weights along the input dim."""
    n, k = w.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, got {k}")
    g = w.abs().reshape(n, k // 4, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(-1, g.topk(2, dim=-1).indices, True)
    return keep.reshape(n, k)


@torch.no_grad()
def prune_masked(model: nn.Module, pattern: str, sparsity: float = 0.5
                 ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy with ``pattern`` "magnitude" (per-matrix) or "2:4" zeros; returns (model, masks).
    Only nn.Linear weights are masked, so an MoE model (stacked experts) is refused."""
    refuse_moe(model.config, "pruning (prune_masked)")
    model = copy.deepcopy(model)
    masks = {}
    for name, w in decoder_weights(model).items():
        masks[name] = mask_2_4(w) if pattern == "2:4" else magnitude_mask(w, sparsity)
        w.mul_(masks[name])
    return model, masks


def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Re-zero the pruned weights (after every optimizer step while healing)."""
    weights = decoder_weights(model)
    with torch.no_grad():
        for name, m in masks.items():
            weights[name].mul_(m)


def is_2_4(w: torch.Tensor) -> bool:
    """Every group of 4 along the input dim has at most 2 non-zeros."""
    return bool((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).le(2).all())
