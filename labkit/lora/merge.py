"""Merging a LoRA adapter into its base weights, and the QLoRA deployment pitfall.

Merging folds the adapter into the weight it adapts, ``W' = W + scaling * B A``: the merged
model computes exactly what base + adapter computed (up to rounding), with no LoRA cost per
token, but it serves *one* adapter. For a QLoRA adapter the base it learned against is the NF4
one, ``deq(nf4(W))``, and the merge has three ways to go:

* **naive** (:func:`merge_lora` ``mode="nf4"``): ``nf4(deq(nf4(W)) + s B A)``, back into NF4.
  The adapter's update is small next to NF4's step between levels (the block's absmax / ~7), so
  re-quantizing rounds most of it away and moves other weights to neighbouring levels: the
  served model is neither the base nor the trained model. This is the pitfall the lab's notes
  warn about; ``labkit bench qlora`` measures it.
* **de-quantize, merge, re-quantize with a calibrated method**: ``deq(nf4(W)) + s B A`` in
  float (:func:`dequantize_model` then :func:`merge_lora`), then GPTQ (which minimises the
  layer's output error on real activations rather than the weight's rounding error), saved as
  a GPTQ checkpoint: ``labkit lora merge --quantize gptq``.
* **do not merge**: serve the adapter unmerged over the quantized base (labkit's multi-LoRA
  path, ``LLM(enable_lora=True)``), exactly what was trained, at the cost of the LoRA delta.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from labkit.lora.adapter import SUPPORTED_MODULES, load_adapter


def lora_target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of every projection an adapter may target (any linear kind)."""
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in SUPPORTED_MODULES and hasattr(m, "in_features")}


def adapter_deltas(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """``{module path: scaling * B @ A}`` ([out, in] float32) of a PEFT adapter folder, checked
    against ``model``'s shapes (:func:`~labkit.lora.adapter.load_adapter`'s errors)."""
    lm = load_adapter(0, adapter, lora_target_shapes(model), max_lora_rank=1 << 30)
    return {n: lm.scaling * (b.double() @ a.double()).float() for n, (a, b) in lm.weights.items()}


def _weight(m: nn.Module) -> torch.Tensor:
    return m.dequantize().float() if hasattr(m, "dequantize") else m.weight.detach().float()


def _linear(w: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=like.device,
                    dtype=like.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _embed_dtype(model: nn.Module) -> torch.Tensor:
    return next(model.parameters()).detach()


@torch.no_grad()
def dequantize_model(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Every quantized decoder linear (anything with ``dequantize()``) back to an ``nn.Linear``
    holding exactly the weight it computed with: the "de-quantized base"."""
    model = model if inplace else copy.deepcopy(model)
    like = _embed_dtype(model)
    for name, m in list(model.named_modules()):
        if hasattr(m, "dequantize") and hasattr(m, "in_features"):
            b = None if getattr(m, "bias", None) is None else m.bias.detach().float()
            _set(model, name, _linear(m.dequantize().float(), b, like))
    return model


@torch.no_grad()
def merge_lora(model: nn.Module, adapter: str, mode: str = "fp",
               inplace: bool = False) -> nn.Module:
    """Fold the adapter into ``model``'s targeted projections.

    ``mode="fp"``: each becomes an ``nn.Linear`` with ``W + s B A`` (W de-quantized first if
    the layer was quantized). ``mode="nf4"``: each must be an NF4 layer and stays one,
    re-quantized from ``deq(W) + s B A`` with its block size (the naive QLoRA merge)."""
    if mode not in ("fp", "nf4"):
        raise ValueError(f"mode must be 'fp' or 'nf4', got {mode!r}")
    model = model if inplace else copy.deepcopy(model)
    like = _embed_dtype(model)
    for name, delta in adapter_deltas(model, adapter).items():
        m = model.get_submodule(name)
        b = None if getattr(m, "bias", None) is None else m.bias.detach().float()
        w = _weight(m) + delta.to(_weight(m).device)
        if mode == "fp":
            _set(model, name, _linear(w, b, like))
            continue
        from labkit.quant.linear import NF4Linear
        from labkit.quant.nf4 import quantize_nf4

        if not isinstance(m, NF4Linear):
            raise ValueError(f"mode='nf4' re-quantizes NF4 layers; {name} is "
                             f"{type(m).__name__} (quantize the base with 'nf4' first)")
        _set(model, name, NF4Linear(quantize_nf4(w, m.blocksize), b).to(w.device))
    return model
