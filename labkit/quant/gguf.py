"""GGUF quantization types: labkit's block quantizers, and which tensor gets which type.

``quantize(array, "q8_0" | "q4_0" | "q5_0" | "q4_k" | "q6_k")`` returns the raw GGML block bytes
shaped like ``gguf.quants.quantize``: the last axis of n weights becomes n / block_size * bytes
per block. The bytes come from :mod:`labkit.quant.gguf_quants` (numpy, step for step llama.cpp's
reference C), so a file labkit writes is the file ``llama-quantize`` would write.

A *file type* such as Q4_K_M is not one quantization type but a per-tensor mix, decided by
llama.cpp's ``llama_tensor_get_type``. :func:`tensor_type` reproduces the rules that matter for a
Llama-family model: the output projection (or the tied embedding that doubles as it) gets Q6_K,
half-ish of the layers' ``attn_v`` and ``ffn_down`` (the first and last eighth, and every third
in between) get Q6_K, everything else Q4_K; a row length that is not a multiple of 256 falls back
to a 32-block type (Q4_K -> Q5_0, Q6_K -> Q8_0), and norms stay float32.
"""

from __future__ import annotations

import numpy as np

from labkit.quant.errors import QuantizationError
from labkit.quant.gguf_quants import BLOCK_BYTES, BLOCK_SIZE, QUANTIZERS

FILE_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k_m")
FILE_TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15}  # llama_ftype
TENSOR_TYPES = ("f32", "f16", *QUANTIZERS)
_BASE_TYPE = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": "q4_k"}
_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}


def ggml_type(name: str):
    """labkit's lower-case type name -> gguf.GGMLQuantizationType."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


def block_size(qtype: str) -> int:
    return 1 if qtype in ("f32", "f16") else BLOCK_SIZE[qtype]


def bits_per_weight(qtype: str) -> float:
    if qtype in ("f32", "f16"):
        return 32.0 if qtype == "f32" else 16.0
    return 8.0 * BLOCK_BYTES[qtype] / BLOCK_SIZE[qtype]


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """Raw GGML bytes for ``array`` (rows along the last axis), shaped like gguf's output."""
    if qtype not in QUANTIZERS:
        raise QuantizationError(f"unknown GGUF block type {qtype!r}; choose one of "
                                f"{', '.join(QUANTIZERS)}")
    a = np.asarray(array, dtype=np.float32)
    if a.ndim == 0 or a.shape[-1] % BLOCK_SIZE[qtype]:
        raise QuantizationError(f"{qtype} quantizes rows in blocks of {BLOCK_SIZE[qtype]}; the "
                                f"last axis of shape {a.shape} is not a multiple of it")
    if not np.isfinite(a).all():
        raise QuantizationError("array holds NaN or inf; GGUF block scales cannot encode them")
    out = QUANTIZERS[qtype](a.reshape(-1))
    n_bytes = a.shape[-1] // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype]
    return out.reshape(*a.shape[:-1], n_bytes)


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Float32 weights from raw bytes, through the ``gguf`` package's reference dequantizer."""
    from gguf.quants import dequantize as _dequantize

    return _dequantize(np.asarray(raw), ggml_type(qtype))


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: first/last eighth, every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 \
        or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], file_type: str, n_layers: int,
                tied_embeddings: bool) -> str:
    """The GGML type llama-quantize gives tensor ``name`` (llama.cpp naming) in ``file_type``.

    ``shape`` is numpy order ([rows, row_length]); the row length decides block compatibility.
    """
    if file_type not in FILE_TYPES:
        raise QuantizationError(f"unknown GGUF file type {file_type!r}; choose one of "
                                f"{', '.join(FILE_TYPES)}")
    if len(shape) < 2 or file_type == "f32":
        return "f32"  # norms and biases: tiny, and precision matters there
    if file_type == "f16":
        return "f16"
    base = _BASE_TYPE[file_type]
    qtype = base
    ncols = shape[-1]
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        # the vocabulary projection is the most quantization-sensitive matmul
        qtype = "q8_0" if ncols % BLOCK_SIZE[base] else base if base == "q8_0" else "q6_k"
    elif file_type == "q4_k_m" and name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        qtype = "q6_k" if use_more_bits(layer, n_layers) else "q4_k"
    if ncols % BLOCK_SIZE[qtype]:
        qtype = _FALLBACK.get(qtype, qtype)
        if ncols % BLOCK_SIZE[qtype]:
            qtype = "f16"  # llama.cpp's last resort for a row no block type fits
    return qtype


def encode_tensor(array: np.ndarray, qtype: str) -> np.ndarray:
    """What goes into the file for ``qtype``: float arrays for f32/f16, block bytes otherwise."""
    if qtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if qtype == "f16":
        return np.ascontiguousarray(array, dtype=np.float16)
    return quantize(array, qtype)
