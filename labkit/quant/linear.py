"""Quantized linear layers that replace ``nn.Linear`` in the model (and so in the engine).

Each stores its weight in a real packed format (the tensors a checkpoint holds) and computes
``y = x Wᵀ + b`` without materialising W where a packed kernel exists: the Triton
``dequant_matmul`` kernels on CUDA, and on CPU PyTorch's INT8 / INT4 weight-only kernels
(labkit.quant.cpu_packed; INT8, INT4 RTN, GPTQ incl. act-order, AWQ). Everything else (NF4, FP8,
layouts the kernels do not take) dequantizes the whole weight and runs one matmul: the simple
reference, and what ``use_cpu_packed(False)`` forces for comparison.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quant import cpu_packed, packing
from labkit.quant.nf4 import NF4_CODE, Blockwise4bit, DoubleQuantAbsmax, unpack_4bit
from labkit.quant.rtn import GroupQuant


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


_CPU_PACKED = {"enabled": True}


@contextmanager
def use_cpu_packed(enabled: bool) -> Iterator[None]:
    """Switch the packed CPU kernels on/off (off = the dequantize-then-matmul reference)."""
    old = _CPU_PACKED["enabled"]
    _CPU_PACKED["enabled"] = enabled
    try:
        yield
    finally:
        _CPU_PACKED["enabled"] = old


_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_UNSET = object()


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

    def _build_cpu_pack(self) -> cpu_packed.Int8Pack | cpu_packed.Int4Pack | None:
        """The weight repacked for a CPU kernel, or None (then the layer dequantizes)."""
        return None

    def cpu_pack(self) -> cpu_packed.Int8Pack | cpu_packed.Int4Pack | None:
        """Built once from the stored buffers (at the first CPU call) and kept beside them:
        the checkpoint layout stays the source of truth (save, GPU kernels, byte counts)."""
        if not hasattr(self, "_cpu_pack"):
            self._cpu_pack = self._build_cpu_pack()
        return self._cpu_pack

    def _drop_cpu_pack(self) -> None:
        self.__dict__.pop("_cpu_pack", None)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(): the pack is stale
        self._drop_cpu_pack()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._drop_cpu_pack()
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Kept lean: on a 5 M-parameter model at batch 1 every µs of Python here is visible.
        y = None
        if x.is_cuda:
            if _use_kernel(x):
                y = self._kernel_matmul(x.reshape(-1, self.in_features).contiguous())
        elif _CPU_PACKED["enabled"] and x.dtype in _CPU_DTYPES:
            pack = self.__dict__.get("_cpu_pack", _UNSET)
            if pack is _UNSET:
                pack = self.cpu_pack()
            if pack is not None:
                y = pack.matmul(x.reshape(-1, self.in_features))
        if y is not None:
            y = y.view(*x.shape[:-1], self.out_features)
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

    def _build_cpu_pack(self):
        return cpu_packed.pack_int8(self.qweight, self.scales)


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

    def _build_cpu_pack(self):
        if self.bits > 4:
            return None
        codes, zeros = packing.unpack_gptq(self.qweight, self.qzeros, self.bits)
        return cpu_packed.pack_int4(codes, zeros, self.scales, self.g_idx, self.group_size,
                                     self.bits)


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

    def _build_cpu_pack(self):
        codes, zeros = packing.unpack_awq(self.qweight, self.qzeros)
        g_idx = torch.arange(self.in_features) // self.group_size
        return cpu_packed.pack_int4(codes, zeros, self.scales, g_idx, self.group_size)


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
