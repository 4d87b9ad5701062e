"""Quantize a whole model: swap every decoder ``nn.Linear`` for a quantized layer.

``lm_head`` and the embeddings stay in full precision, as in GPTQ/AWQ checkpoints (they are a
small share of a 7B model's bytes and the most sensitive to rounding). The GPTQ driver walks the
decoder layer by layer: inputs of layer i come from layers 0..i-1 *already quantized*, so each
layer's compensation also absorbs the error that reached it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.model.moe import refuse_moe
from labkit.quant.calib import check_calibration, hooks, run_to_layer
from labkit.quant.errors import QuantizationError
from labkit.quant.fp8 import quantize_fp8
from labkit.quant.gptq import HessianAccumulator, gptq_quantize
from labkit.quant.linear import FP8Linear, GPTQLinear, NF4Linear, W8A16Linear
from labkit.quant.nf4 import double_quantize, quantize_nf4
from labkit.quant.rtn import quantize_int8, quantize_rtn

WEIGHT_FORMATS = ("int8", "int4_rtn", "nf4", "fp8")


def decoder_linears(model: nn.Module, layer: nn.Module | None = None
                    ) -> list[tuple[str, nn.Linear]]:
    """(qualified name, module) of every nn.Linear inside the decoder layers (not lm_head)."""
    root = layer if layer is not None else model.model.layers
    prefix = "" if layer is not None else "model.layers."
    return [(prefix + n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)]


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _bias(m: nn.Linear) -> torch.Tensor | None:
    return None if m.bias is None else m.bias.detach().float()


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str, *, bits: int = 4, group_size: int = 128,
                   sym: bool = False, blocksize: int = 64, double_quant: bool = False,
                   group_fallback: bool = False, inplace: bool = False) -> nn.Module:
    """Round-to-nearest formats: "int8" (W8A16), "int4_rtn" (GPTQ layout), "nf4", "fp8".

    ``group_fallback``: a layer whose in_features the group size does not divide uses the
    largest smaller group size that does, instead of raising."""
    if fmt not in WEIGHT_FORMATS:
        raise QuantizationError(f"unknown format {fmt!r}; choose one of {WEIGHT_FORMATS} "
                                "(GPTQ and AWQ need calibration: gptq_quantize_model, "
                                "awq_quantize_model)")
    refuse_moe(model.config, f"weight quantization (quantize_model {fmt!r})")
    model = model if inplace else copy.deepcopy(model)
    for name, lin in decoder_linears(model):
        w, b = lin.weight.detach().float(), _bias(lin)
        if fmt == "int8":
            new = W8A16Linear(*quantize_int8(w), bias=b)
        elif fmt == "int4_rtn":
            new = GPTQLinear.from_quant(quantize_rtn(w, bits, group_size, sym, group_fallback),
                                        b)
        elif fmt == "nf4":
            q = quantize_nf4(w, blocksize)
            new = NF4Linear(q, b, double_quantize(q.absmax) if double_quant else None)
        else:
            new = FP8Linear(*quantize_fp8(w), bias=b)
        set_module(model, name, new.to(lin.weight.device))
    return model


@torch.no_grad()
def gptq_quantize_model(model: nn.Module, calibration: torch.Tensor, *, bits: int = 4,
                        group_size: int = 128, sym: bool = False, act_order: bool = False,
                        damp: float = 0.01, batch_size: int = 8, progress: bool = True,
                        group_fallback: bool = False, inplace: bool = False
                        ) -> tuple[nn.Module, list[dict]]:
    """GPTQ every decoder linear, layer by layer. Returns (model with GPTQLinear, report).

    The report has one row per linear: GPTQ's objective and, on the same Hessian, the error
    tr(E H Eᵀ)/2 of plain RTN vs GPTQ — the number GPTQ exists to shrink.
    """
    refuse_moe(model.config, "weight quantization (gptq_quantize_model)")
    calibration = check_calibration(calibration)
    model = model if inplace else copy.deepcopy(model)
    layers = model.model.layers
    results, report = {}, []
    bar = tqdm(range(len(layers)), desc="GPTQ", disable=not progress)
    for i in bar:
        linears = decoder_linears(model, layers[i])
        acc = {n: HessianAccumulator(m.in_features) for n, m in linears}
        handles = [m.register_forward_hook(lambda _m, inp, _o, a=acc[n]: a.add(inp[0]))
                   for n, m in linears]
        with hooks(handles):
            run_to_layer(model, calibration, layers[i], batch_size)
        for n, m in linears:
            r = gptq_quantize(m.weight.float(), acc[n].H, bits, group_size, sym, act_order, damp,
                              group_fallback=group_fallback)
            m.weight.copy_(r.quant.dequantize().to(m.weight.dtype))  # later layers see this
            results[f"model.layers.{i}.{n}"] = r
            report.append({"layer": f"model.layers.{i}.{n}", "gptq_loss": r.loss,
                           "rtn_error": r.rtn_loss, "gptq_error": r.gptq_hloss})
        bar.set_postfix(err_ratio=sum(x["gptq_error"] for x in report[-len(linears):]) /
                        max(sum(x["rtn_error"] for x in report[-len(linears):]), 1e-30))
    for name, r in results.items():
        lin = model.get_submodule(name)
        set_module(model, name, GPTQLinear.from_quant(r.quant, _bias(lin)).to(lin.weight.device))
    return model, report
