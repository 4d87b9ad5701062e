"""NF4 dequantisation in bitsandbytes' layout: 4-bit codes into a 16-entry normal-float table.

Layout: ``packed`` uint8 [numel/2] (two codes per byte, the first element in the HIGH nibble),
``absmax`` fp32 [numel/blocksize] (one scale per block of consecutive elements, flat order);
``value = NF4_LEVELS[code] * absmax[element // blocksize]``. One program per BLOCK packed bytes::

    packed bytes  [ b0 | b1 | ... ]        b = hi:lo
    outputs       [ e0 e1 | e2 e3 | ... ]  e(2i) = code[hi(b_i)], e(2i+1) = code[lo(b_i)]

The 16-entry table sits in L1 after the first touch, so each byte costs one gather from cache.
What bounds it: memory, 0.5 byte read + 2 bytes written (fp16) per element, ~1 FLOP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from labkit.kernels._common import FLOAT_DTYPES, check
from labkit.kernels.nf4_code import NF4_LEVELS

_CODE_CACHE: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _nf4_kernel(out_ptr, packed_ptr, absmax_ptr, code_ptr, n_bytes, numel, blocksize,
                BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    hi = tl.load(code_ptr + (b >> 4), mask=mask, other=0.0)
    lo = tl.load(code_ptr + (b & 0xF), mask=mask, other=0.0)
    # Both elements of a byte share a block because blocksize is even.
    scale = tl.load(absmax_ptr + (2 * offs) // blocksize, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + 2 * offs, (hi * scale).to(dtype), mask=mask)
    # An odd numel leaves the last byte's low nibble as padding.
    tl.store(out_ptr + 2 * offs + 1, (lo * scale).to(dtype), mask=mask & (2 * offs + 1 < numel))


def _code(device: torch.device) -> torch.Tensor:
    if device not in _CODE_CACHE:
        _CODE_CACHE[device] = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return _CODE_CACHE[device]


def nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                   shape: tuple[int, ...] | torch.Size,
                   dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Unpack NF4 codes into a tensor of ``shape`` and ``dtype`` (bitsandbytes layout)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    check(packed.dtype == torch.uint8, f"packed must be uint8, got {packed.dtype}")
    check(dtype in FLOAT_DTYPES, f"dtype must be fp16, bf16 or fp32, got {dtype}")
    check(absmax.is_floating_point() and absmax.device == packed.device,
          f"absmax must be a float tensor on packed's device, got {absmax.dtype} on "
          f"{absmax.device}")
    check(packed.numel() == (numel + 1) // 2,
          f"packed has {packed.numel()} bytes, shape {tuple(shape)} needs {(numel + 1) // 2}")
    check(blocksize > 0 and blocksize % 2 == 0, f"blocksize must be even, got {blocksize}")
    check(absmax.numel() == triton.cdiv(numel, blocksize),
          f"absmax must have ceil(numel / blocksize) = {triton.cdiv(numel, blocksize)} "
          f"entries, got {absmax.numel()}")
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    n_bytes = (numel + 1) // 2
    if n_bytes:
        block = 1024
        _nf4_kernel[(triton.cdiv(n_bytes, block),)](
            out, packed.reshape(-1), absmax.float().reshape(-1).contiguous(),
            _code(packed.device), n_bytes, numel, blocksize, BLOCK=block,
        )
    return out.view(*shape)


def nf4_dequantize_ref(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                       shape: tuple[int, ...] | torch.Size,
                       dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Plain PyTorch: split nibbles (high first), look up, scale by the flat block's absmax."""
    b = packed.reshape(-1).long()
    codes = torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)
    table = _code(packed.device)  # the same 16 constants; cached so CUDA graphs can capture
    numel = 1
    for s in shape:
        numel *= int(s)
    codes = codes[:numel]
    scale = absmax.float().reshape(-1).repeat_interleave(blocksize)[:numel]
    return (table[codes] * scale).to(dtype).view(*shape)
