"""Quantized linear layers that replace ``nn.Linear`` in the model (and so in the engine).

Each stores its weight in a real packed format (the tensors a checkpoint holds) and computes
``y = x Wᵀ + b`` by dequantizing: in PyTorch on CPU (dequantize the whole weight, then one
matmul — simple, and on CPU the matmul dominates anyway), with the Triton ``dequant_matmul``
kernels on CUDA, which never materialise W in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quant import packing
from labkit.quant.nf4 import NF4_CODE, Blockwise4bit, DoubleQuantAbsmax, unpack_4bit
from labkit.quant.rtn import GroupQuant


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _kernels():
    from labkit.kernels import dequant_matmul

    return dequant_matmul


class QuantLinear(nn.Module):
    """Common bits: shape, optional bias, and the CPU path ``F.linear(x, dequantize())``."""

    format: str = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """The weight as [out, in] float32, exactly what the layer computes with."""
        raise NotImplementedError

    def _kernel_matmul(self, x2d: torch.Tensor) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernel(x):
            y = self._kernel_matmul(x.reshape(-1, self.in_features).contiguous())
            if y is not None:
                y = y.reshape(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"format={self.format}"


class W8A16Linear(QuantLinear):
    """INT8 weight [N, K] with one fp16 scale per output channel."""

    format = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.to(torch.int8))
        self.register_buffer("scales", scales.to(torch.float16))

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def _kernel_matmul(self, x2d):
        return _kernels().w8a16_matmul(x2d, self.qweight, self.scales.to(x2d.dtype))


class GPTQLinear(QuantLinear):
    """GPTQ layout (also holds INT4 RTN results: g_idx is then arange(K) // group_size)."""

    format = "gptq"

    def __init__(self, qweight, qzeros, scales, g_idx, bits: int = 4, group_size: int = 128,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[0] * 32 // bits, qweight.shape[1], bias)
        self.bits, self.group_size = bits, group_size
        self.register_buffer("qweight", qweight.to(torch.int32))
        self.register_buffer("qzeros", qzeros.to(torch.int32))
        self.register_buffer("scales", scales.to(torch.float16))
        self.register_buffer("g_idx", g_idx.to(torch.int32))

    @classmethod
    def from_quant(cls, q: GroupQuant, bias: torch.Tensor | None = None) -> GPTQLinear:
        qweight, qzeros = packing.pack_gptq(q.codes, q.zeros, q.bits)
        return cls(qweight, qzeros, q.scales.half(), q.g_idx, q.bits, q.group_size, bias)

    def dequantize(self) -> torch.Tensor:
        return packing.dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx,
                                       self.bits)

    def _kernel_matmul(self, x2d):
        if self.bits != 4:
            return None
        return _kernels().gptq_matmul(x2d, self.qweight, self.qzeros,
                                      self.scales.to(x2d.dtype), self.g_idx)


class AWQLinear(QuantLinear):
    """AutoAWQ GEMM layout, 4-bit, group = k // group_size."""

    format = "awq"

    def __init__(self, qweight, qzeros, scales, group_size: int = 128,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[0], qweight.shape[1] * 8, bias)
        self.bits, self.group_size = 4, group_size
        self.register_buffer("qweight", qweight.to(torch.int32))
        self.register_buffer("qzeros", qzeros.to(torch.int32))
        self.register_buffer("scales", scales.to(torch.float16))

    @classmethod
    def from_quant(cls, q: GroupQuant, bias: torch.Tensor | None = None) -> AWQLinear:
        qweight, qzeros = packing.pack_awq(q.codes, q.zeros)
        return cls(qweight, qzeros, q.scales.half(), q.group_size, bias)

    def dequantize(self) -> torch.Tensor:
        return packing.dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size)

    def _kernel_matmul(self, x2d):
        return _kernels().awq_matmul(x2d, self.qweight, self.qzeros,
                                     self.scales.to(x2d.dtype), self.group_size)


class NF4Linear(QuantLinear):
    """bitsandbytes NF4 storage: packed uint8 codes + per-block absmax (optionally 8-bit)."""

    format = "nf4"

    def __init__(self, q: Blockwise4bit, bias: torch.Tensor | None = None,
                 double_quant: DoubleQuantAbsmax | None = None) -> None:
        if q.quant_type != "nf4" or len(q.shape) != 2:
            raise ValueError("NF4Linear needs an NF4-quantized 2-D weight")
        super().__init__(q.shape[1], q.shape[0], bias)
        self.blocksize = q.blocksize
        self.register_buffer("packed", q.packed())
        if double_quant is None:
            self.register_buffer("absmax", q.absmax.float())
        else:
            self.register_buffer("absmax_q8", double_quant.q8)
            self.register_buffer("absmax_scale", double_quant.scale.float())
            self.register_buffer("absmax_offset", torch.tensor(double_quant.offset))

    def _absmax(self) -> torch.Tensor:
        if hasattr(self, "absmax"):
            return self.absmax
        return DoubleQuantAbsmax(self.absmax_q8, self.absmax_scale,
                                 float(self.absmax_offset)).dequantize()

    def dequantize(self) -> torch.Tensor:
        n = self.in_features * self.out_features
        codes = unpack_4bit(self.packed, n)
        vals = NF4_CODE.to(self.packed.device)[codes.long()]
        scale = self._absmax().repeat_interleave(self.blocksize)[:n]
        return (vals * scale).view(self.out_features, self.in_features)


class FP8Linear(QuantLinear):
    """float8_e4m3fn weight with one fp32 scale per output channel (max|w| -> 448)."""

    format = "fp8"

    def __init__(self, weight_fp8: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(weight_fp8.shape[1], weight_fp8.shape[0], bias)
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("scales", scales.float())

    def dequantize(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.scales[:, None]
