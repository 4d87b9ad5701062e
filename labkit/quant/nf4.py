"""4-bit NormalFloat (NF4) and FP4 with blockwise absmax, as bitsandbytes / QLoRA store them.

NF4's 16 levels are quantiles of a standard normal (rescaled to [-1, 1], with an exact 0), so
each code is used about equally often by normally distributed weights — the information-
theoretically best 4-bit grid for them (QLoRA, Dettmers et al. 2023). Each block of
``blocksize`` consecutive elements (row-major) is divided by its absmax and every value is
mapped to the nearest level. *Double quantization* then stores those fp32 absmax values
themselves in 8 bits (blocks of 256, minus their mean), saving ~0.37 bits per weight.

The codes here equal bitsandbytes 0.50's ``quantize_4bit`` on CPU bit for bit: the same levels,
the same reciprocal-multiply scaling, and the same tie rule (a value exactly half-way between two
levels goes to the lower one), checked in tests/quant/test_nf4.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.kernels.nf4_code import NF4_LEVELS
from labkit.quant.errors import QuantizationError

# The one NF4 table (kernels/nf4_code.py), as a tensor; index = the 4-bit code.
NF4_CODE = torch.tensor(NF4_LEVELS)
# FP4 (1 sign, 2 exponent, 1 mantissa bits), bitsandbytes' code order; sign is bit 3.
FP4_CODE = torch.tensor([
    0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5,
    0.1666666716337204, 0.25, -0.0, -0.0052083334885537624, -0.6666666865348816, -1.0,
    -0.3333333432674408, -0.5, -0.1666666716337204, -0.25])
SUPPORTED_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DQ_BLOCKSIZE = 256  # double quantization groups this many absmax values


def _nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level; ties go to the lower level (bucketize over midpoints)."""
    # sort by value, stable, so equal levels (FP4's +0 / -0) keep code order
    order = torch.sort(code, stable=True).indices
    levels = code[order]
    midpoints = (levels[:-1] + levels[1:]) / 2
    return order[torch.bucketize(x, midpoints)]


@dataclass
class Blockwise4bit:
    """Unpacked 4-bit codes + per-block absmax; ``.packed()`` is bitsandbytes' storage."""

    codes: torch.Tensor  # uint8 [numel], one code 0..15 per element, row-major
    absmax: torch.Tensor  # float32 [ceil(numel / blocksize)]
    shape: tuple[int, ...]
    blocksize: int
    quant_type: str  # "nf4" | "fp4"

    @property
    def code(self) -> torch.Tensor:
        return NF4_CODE if self.quant_type == "nf4" else FP4_CODE

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        vals = self.code[self.codes.long()]
        n = vals.numel()
        scale = self.absmax.repeat_interleave(self.blocksize)[:n]
        return (vals * scale).reshape(self.shape).to(dtype)

    def packed(self) -> torch.Tensor:
        """uint8 [ceil(numel/2)]: two codes per byte, the first element in the HIGH nibble."""
        c = self.codes
        if c.numel() % 2:  # pad with the code of 0.0, as bitsandbytes does
            c = torch.cat([c, _nearest_code(torch.zeros(1), self.code).to(torch.uint8)])
        return (c[0::2] << 4) | c[1::2]


def unpack_4bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    p = packed.reshape(-1).to(torch.uint8)
    return torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)[:numel]


def _quantize_blockwise_4bit(w: torch.Tensor, blocksize: int, quant_type: str) -> Blockwise4bit:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise QuantizationError("expected a floating-point tensor to quantize")
    if w.numel() == 0:
        raise QuantizationError("cannot quantize an empty tensor")
    if blocksize not in SUPPORTED_BLOCKSIZES:
        raise QuantizationError(f"blocksize={blocksize} is not supported; choose one of "
                                f"{SUPPORTED_BLOCKSIZES}")
    flat = w.detach().reshape(-1).float().cpu()
    n = flat.numel()
    nblocks = -(-n // blocksize)
    padded = torch.zeros(nblocks * blocksize)
    padded[:n] = flat
    blocks = padded.view(nblocks, blocksize)
    absmax = blocks.abs().amax(dim=1)
    inv = 1.0 / absmax.clamp(min=1e-38)
    full = n // blocksize
    scaled = (blocks * inv[:, None]).clamp(-1, 1)
    if full < nblocks:  # bitsandbytes divides the ragged last block instead of multiplying,
        absmax[full] = absmax[full].clamp(min=1e-38)  # and stores its absmax clamped
        scaled[full] = (blocks[full] / absmax[full]).clamp(-1, 1)
    code = NF4_CODE if quant_type == "nf4" else FP4_CODE
    codes = _nearest_code(scaled.reshape(-1)[:n], code).to(torch.uint8)
    return Blockwise4bit(codes, absmax, tuple(w.shape), blocksize, quant_type)


def quantize_nf4(weight: torch.Tensor, blocksize: int = 64) -> Blockwise4bit:
    """NF4 codes and absmax for ``weight`` (any shape, flattened row-major)."""
    return _quantize_blockwise_4bit(weight, blocksize, "nf4")


def quantize_fp4(weight: torch.Tensor, blocksize: int = 64) -> Blockwise4bit:
    """FP4 (E2M1) codes and absmax, bitsandbytes' other 4-bit type."""
    return _quantize_blockwise_4bit(weight, blocksize, "fp4")


# ---- double quantization of the absmax values -----------------------------------------------
@dataclass
class DoubleQuantAbsmax:
    """absmax ≈ q8 * scale[block] + offset: 8-bit codes, one fp32 scale per 256 absmax values."""

    q8: torch.Tensor  # int8 [nblocks]
    scale: torch.Tensor  # float32 [ceil(nblocks / 256)]
    offset: float

    def dequantize(self) -> torch.Tensor:
        s = self.scale.repeat_interleave(DQ_BLOCKSIZE)[: self.q8.numel()]
        return self.q8.float() * s + self.offset


def double_quantize(absmax: torch.Tensor) -> DoubleQuantAbsmax:
    """QLoRA's second level: absmax values minus their mean, symmetric INT8 per 256-block.

    (bitsandbytes uses its dynamic 8-bit float code here; labkit uses plain symmetric INT8,
    which keeps the idea and the memory saving — the exact bytes differ.)
    """
    offset = float(absmax.mean())
    centred = absmax.float() - offset
    n = centred.numel()
    nb = -(-n // DQ_BLOCKSIZE)
    padded = torch.zeros(nb * DQ_BLOCKSIZE)
    padded[:n] = centred
    scale = (padded.view(nb, DQ_BLOCKSIZE).abs().amax(dim=1) / 127).clamp(min=1e-12)
    q8 = torch.round(centred / scale.repeat_interleave(DQ_BLOCKSIZE)[:n]).clamp(-127, 127)
    return DoubleQuantAbsmax(q8.to(torch.int8), scale, offset)
