"""Keeping a GGUF's Q4_0 weights quantized in labkit: Q4_0 blocks *are* GPTQ groups of 32.

A Q4_0 block stores ``w = d * (q - 8)`` for 32 consecutive weights of a row: that is exactly
GPTQ's asymmetric grid ``(q - zero) * scale`` with group size 32, zero = 8 and the fp16 scale d.
So a Q4_0 tensor converts to a :class:`~labkit.quant.linear.GPTQLinear` with no rounding at all,
and the model keeps 4.5 bits per weight in memory instead of float32 (Q4_K's float *min* has no
integer zero-point, so it has no such exact twin and is dequantized like everything else).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from labkit.model.gguf_loader import gguf_name, load_gguf, permute_heads, rope_unpermute
from labkit.model.llama import LlamaForCausalLM
from labkit.model.tokenizer import Tokenizer
from labkit.quant.linear import GPTQLinear
from labkit.quant.rtn import GroupQuant


def q4_0_to_group_quant(raw: np.ndarray) -> GroupQuant:
    """Raw Q4_0 bytes [N, K/32 * 18] -> GroupQuant (codes [N, K], scales/zeros [K/32, N])."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 18)
    g = blocks.shape[1]
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # [N, G]
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, g * 32)  # j, then j+16
    return GroupQuant(codes=torch.from_numpy(codes.astype(np.uint8)),
                      scales=torch.from_numpy(d.T.astype(np.float32)),
                      zeros=torch.full((g, n), 8, dtype=torch.int32),
                      g_idx=torch.arange(g * 32, dtype=torch.int32) // 32, bits=4, group_size=32)


def load_gguf_keep_q4_0(path: str | os.PathLike) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """Like ``load_pretrained(path)``, but every Q4_0 linear becomes a GPTQLinear (exact)."""
    from gguf import GGMLQuantizationType, GGUFReader

    model, tok = load_gguf(path)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        t = tensors[gguf_name(f"{name}.weight")]
        if t.tensor_type != GGMLQuantizationType.Q4_0:
            continue
        raw = np.asarray(t.data)
        if (heads := permute_heads(f"{name}.weight", model.config)) is not None:
            raw = rope_unpermute(raw, heads)  # whole rows move; blocks never straddle rows
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                GPTQLinear.from_quant(q4_0_to_group_quant(raw), module.bias))
    return model, tok
