"""bitsandbytes as an alternative backend: swap decoder linears for ``bnb.nn.Linear4bit``.

labkit's own NF4 (``labkit.quant.nf4`` + ``NF4Linear``) shows how the format works; this path
uses the library QLoRA fine-tuning actually runs on, so the two can be compared side by side.
The 4-bit codes are identical (tests/quant/test_nf4.py); with ``double_quant=True``
bitsandbytes compresses absmax with its own 8-bit dynamic code, which labkit does not copy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from labkit.quant.errors import QuantizationError
from labkit.quant.model import decoder_linears, set_module


def to_bnb_linear4bit(model: nn.Module, quant_type: str = "nf4", blocksize: int = 64,
                      double_quant: bool = False, compute_dtype: torch.dtype = torch.float32,
                      inplace: bool = False) -> nn.Module:
    """A copy of ``model`` whose decoder linears are bitsandbytes ``Linear4bit`` layers."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise QuantizationError("bitsandbytes is not installed: pip install "
                                "'labkit[quant]'") from e
    if quant_type not in ("nf4", "fp4"):
        raise QuantizationError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    model = model if inplace else copy.deepcopy(model)
    for name, lin in decoder_linears(model):
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                compute_dtype=compute_dtype, quant_type=quant_type,
                                compress_statistics=double_quant)
        new.weight = bnb.nn.Params4bit(lin.weight.data.float().clone(), requires_grad=False,
                                       quant_type=quant_type, blocksize=blocksize,
                                       compress_statistics=double_quant)
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=False)
        set_module(model, name, new.to(lin.weight.device))  # .to() quantizes
    return model
