"""AWQ (Lin et al., 2023): protect the weights that meet large activations, by scaling.

Quantization error of a weight matters in proportion to the activation it multiplies. AWQ
multiplies input channel j of a linear by ``s_j`` and divides the *preceding* operation's output
channel j by ``s_j`` — an exact identity in full precision — so channels with large mean |x| get
relatively finer quantization steps. ``s = mean|x|^α`` with α chosen per layer group by a grid
search that minimises the group's real output error after INT4 fake-quantization (α = 0 is plain
RTN, so the search can only help). Where the scale is folded:

  q/k/v_proj   <- input_layernorm weight          (loss on the whole self_attn output)
  o_proj       <- v_proj rows. With GQA one v channel feeds the same channel of every query
                  head in its group, so those o_proj columns must share one scale: labkit ties
                  their statistics (AutoAWQ instead skips o_proj when the shapes differ)
  gate/up_proj <- post_attention_layernorm weight (loss on the mlp output)
  down_proj    <- up_proj rows                    (silu(gate)·up is linear in up)

Then an optional clipping search shrinks each group's max |w| if that lowers output error, and
every linear is quantized round-to-nearest (asymmetric INT4, groups) into AutoAWQ's GEMM layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.model.moe import refuse_moe
from labkit.quant.calib import check_calibration, hooks, run_to_layer
from labkit.quant.errors import resolve_group_size
from labkit.quant.linear import AWQLinear
from labkit.quant.model import decoder_linears, set_module
from labkit.quant.rtn import fake_quantize, group_params, quantize_codes, quantize_rtn

N_GRID = 20


class _Captured:
    """Inputs of one module, one entry per calibration batch (args, kwargs)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _m, args, kwargs):
        self.calls.append((args, kwargs))

    def x(self) -> torch.Tensor:
        """The first positional input of every call, flattened to [tokens, features]."""
        return torch.cat([a[0].reshape(-1, a[0].shape[-1]) for a, _ in self.calls]).float()

    def replay(self, module: nn.Module, max_calls: int | None = None) -> torch.Tensor:
        outs = []
        for a, kw in self.calls[:max_calls]:
            out = module(*a, **kw)
            outs.append((out[0] if isinstance(out, tuple) else out).float().reshape(-1))
        return torch.cat(outs)


def _set_weights(linears: list[nn.Linear], weights: list[torch.Tensor]) -> None:
    for lin, w in zip(linears, weights):
        lin.weight.copy_(w.to(lin.weight.dtype))


@torch.no_grad()
def search_scales(x: torch.Tensor, linears: list[nn.Linear], inspect: Callable[[], torch.Tensor],
                  group_size: int, n_grid: int = N_GRID, group_fallback: bool = False,
                  duo_scaling: bool = False,
                  tie: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, dict]:
    """Grid over α of ``s = mean|x|^α``; returns the best s and {alpha, loss_before, loss_after}.

    ``duo_scaling`` (AutoAWQ's default) divides by ``mean|ŵ|^(1-α)``, ŵ = weights normalised
    by their group's max, so channels whose weights are already large are scaled less.
    ``tie`` makes channels that must share one scale (GQA's o_proj) share their statistics.
    """
    x_mean = x.abs().mean(dim=0)
    tie = tie or (lambda t: t)
    x_mean = tie(x_mean)
    orig = [lin.weight.detach().float().clone() for lin in linears]
    if duo_scaling:
        w = torch.cat(orig)
        gs = resolve_group_size(w.shape[1], group_size, group_fallback)
        wg = w.abs().view(-1, gs)
        w_mean = tie((wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).view_as(w).mean(dim=0))
    ref = inspect()
    losses = []
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        if duo_scaling:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        _set_weights(linears, [fake_quantize(w * s, 4, group_size, False, group_fallback) / s
                               for w in orig])
        losses.append((float((inspect() - ref).pow(2).mean()), alpha, s))
    _set_weights(linears, orig)
    best = min(losses, key=lambda t: t[0])
    return best[2], {"alpha": best[1], "loss_before": losses[0][0], "loss_after": best[0]}


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor,
                prev_s: torch.Tensor | None = None) -> None:
    """prev's output channel j /= s_j; each linear's input column j *= s_j (output unchanged).

    ``prev_s``: the scale on prev's outputs when it differs in length from ``s`` (GQA: one
    v_proj channel feeds the same o_proj channel of every query head in its group).
    """
    if isinstance(prev, nn.Linear):
        ps = s if prev_s is None else prev_s
        prev.weight.div_(ps[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(ps.to(prev.bias.dtype))
    else:  # RMSNorm: y = weight * normalized(x)
        prev.weight.div_(s.to(prev.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))


def _tie_gqa(t: torch.Tensor, kv: int, rep: int, d: int) -> torch.Tensor:
    """Average over the ``rep`` query heads that read the same kv head, then broadcast back."""
    return t.view(kv, rep, d).mean(dim=1, keepdim=True).expand(kv, rep, d).reshape(-1)


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512, group_fallback: bool = False
                ) -> torch.Tensor:
    """Per (row, group) max |w| that minimises the group's partial output error after INT4."""
    N, K = w.shape
    gs = resolve_group_size(K, group_size, group_fallback)
    G = K // gs
    x = x[torch.linspace(0, x.shape[0] - 1, min(n_tokens, x.shape[0])).long()]
    xg = x.view(-1, G, gs)
    wg = w.float().view(N, G, gs)
    ref = torch.einsum("tgk,ngk->tng", xg, wg)
    org_max = wg.abs().amax(dim=-1, keepdim=True)
    best_max, best_err = org_max.clone(), torch.full((N, G, 1), float("inf"))
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        cur = wg.clamp(-max_val, max_val).reshape(-1, gs)
        s, z = group_params(cur, 4)
        q = ((quantize_codes(cur, s, z, 4) - z[:, None]) * s[:, None]).view(N, G, gs)
        err = (torch.einsum("tgk,ngk->tng", xg, q) - ref).pow(2).mean(dim=0)[..., None]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return wg.clamp(-best_max, best_max).view(N, K)


@torch.no_grad()
def awq_quantize_model(model: nn.Module, calibration: torch.Tensor, *, group_size: int = 128,
                       clip: bool = True, n_grid: int = N_GRID, batch_size: int = 8,
                       progress: bool = True, group_fallback: bool = False,
                       duo_scaling: bool = False, search_batches: int | None = 4,
                       inplace: bool = False) -> tuple[nn.Module, list[dict]]:
    """AWQ-scale, clip and INT4-quantize every decoder linear. Returns (model, per-group report).

    Activation statistics use every calibration token; the α search's output loss replays only
    the first ``search_batches`` batches (None = all), which is what makes it affordable on CPU.
    """
    refuse_moe(model.config, "weight quantization (awq_quantize_model)")
    calibration = check_calibration(calibration)
    model = model if inplace else copy.deepcopy(model)
    for _, lin in decoder_linears(model):
        resolve_group_size(lin.in_features, group_size, group_fallback)
    report = []
    for i, layer in enumerate(tqdm(model.model.layers, desc="AWQ", disable=not progress)):
        attn, mlp = layer.self_attn, layer.mlp
        caps = {k: _Captured(m) for k, m in
                (("attn", attn), ("o", attn.o_proj), ("mlp", mlp), ("down", mlp.down_proj))}
        with hooks([c.handle for c in caps.values()]):
            run_to_layer(model, calibration, layer, batch_size)
        groups = [("qkv", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj],
                   caps["attn"], attn)]
        groups.append(("o", attn.v_proj, [attn.o_proj], caps["o"], attn.o_proj))
        groups += [("gate_up", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj],
                    caps["mlp"], mlp),
                   ("down", mlp.up_proj, [mlp.down_proj], caps["down"], mlp.down_proj)]
        kv, rep, d = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim
        for name, prev, linears, cap, module in groups:
            inspect = partial(cap.replay, module, max_calls=search_batches)
            tie = partial(_tie_gqa, kv=kv, rep=rep, d=d) if name == "o" and rep > 1 else None
            x = cap.x()
            s, row = search_scales(x, linears, inspect, group_size, n_grid, group_fallback,
                                   duo_scaling, tie)
            fold_scales(prev, linears, s, s.view(kv, rep, d)[:, 0].reshape(-1) if tie else None)
            report.append({"layer": f"model.layers.{i}.{name}", **row})
            if clip and name != "qkv":  # q/k clipping hurts attention scores (AutoAWQ skips)
                for lin in linears:
                    lin.weight.copy_(search_clip(lin.weight, x / s, group_size,
                                                 group_fallback=group_fallback))
    for name, lin in decoder_linears(model):
        q = quantize_rtn(lin.weight.detach().float(), 4, group_size, False, group_fallback)
        bias = None if lin.bias is None else lin.bias.detach().float()
        set_module(model, name, AWQLinear.from_quant(q, bias).to(lin.weight.device))
    return model, report
