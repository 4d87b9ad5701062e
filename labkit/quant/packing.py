"""Bit packing of 4-bit codes into int32 words, in the two layouts real tools load.

GPTQ (AutoGPTQ / GPTQModel, "v1" format):
  qweight int32 [K*bits/32, N]  packed along the *input* dim; the lowest bits hold the first row.
  qzeros  int32 [G, N*bits/32]  packed along the output dim the same way, storing (zero - 1)
                                (a historical off-by-one every loader undoes).
  scales  fp16  [G, N];  g_idx int32 [K] (group of each input row; act-order permutes it).
AWQ GEMM (AutoAWQ / llm-awq):
  qweight int32 [K, N/8]  packed along the *output* dim with nibble order [0,2,4,6,1,3,5,7]
                          (nibble j holds column AWQ_ORDER[j]: matches the GPU dequant kernel's
                          interleaved unpack); qzeros int32 [G, N/8] the same, raw zeros;
  scales fp16 [G, N]; group = k // group_size.
"""

from __future__ import annotations

import torch

from labkit.quant.errors import QuantizationError, check_bits

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding an unsigned 32-bit pattern -> int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
              ) -> torch.Tensor:
    """Pack along dim 0: rows r*per..r*per+per-1 of ``codes`` [R, C] go into word row r.

    Nibble j (bits j*bits ...) holds element ``order[j]`` of its run (identity by default).
    """
    check_bits(bits)
    per = 32 // bits
    R, C = codes.shape
    if R % per:
        raise QuantizationError(f"cannot pack {R} rows of {bits}-bit codes into int32 words: "
                                f"the packed dim must be divisible by {per}")
    c = codes.to(torch.int64)
    if c.min() < 0 or c.max() >= 2**bits:
        raise QuantizationError(f"codes must lie in [0, {2**bits - 1}]")
    c = c.view(R // per, per, C)
    order = order or tuple(range(per))
    word = torch.zeros(R // per, C, dtype=torch.int64)
    for j, src in enumerate(order):
        word |= c[:, src, :] << (bits * j)
    return _to_int32(word)


def unpack_rows(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 [R/per, C] -> int codes [R, C] (int32)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    # arithmetic shift of a negative int32 drags the sign bit in; the mask removes it
    nib = (words.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)
    if order is not None:  # nibble j holds element order[j]
        nib = nib[:, torch.argsort(torch.tensor(order)), :]
    return nib.reshape(-1, words.shape[1])


# ---- GPTQ -----------------------------------------------------------------------------------
def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K], zeros [G, N] -> (qweight [K*bits/32, N], qzeros [G, N*bits/32])."""
    if (zeros < 1).any():
        raise QuantizationError(
            "a group has zero point 0, which the GPTQ v1 layout (stores zero-1) cannot "
            "represent; quantize with sym=True or keep zeros >= 1")
    qweight = pack_rows(codes.T.contiguous(), bits)
    qzeros = pack_rows((zeros - 1).T.contiguous(), bits).T.contiguous()
    return qweight, qzeros


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes [N, K] int32, zeros [G, N] int32 with the +1 undone)."""
    codes = unpack_rows(qweight, bits).T.contiguous()
    zeros = unpack_rows(qzeros.T.contiguous(), bits).T.contiguous() + 1
    return codes, zeros


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """W [N, K] float32 = (q - z[g_idx]) * s[g_idx]."""
    codes, zeros = unpack_gptq(qweight, qzeros, bits)
    g = g_idx.long()
    return (codes.float() - zeros.T[:, g].float()) * scales.float().T[:, g]


# ---- AWQ GEMM -------------------------------------------------------------------------------
def pack_awq(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K], zeros [G, N] -> (qweight [K, N/8], qzeros [G, N/8]), 4-bit only."""
    qweight = pack_rows(codes.contiguous(), 4, AWQ_ORDER).T.contiguous()
    qzeros = pack_rows(zeros.T.contiguous(), 4, AWQ_ORDER).T.contiguous()
    return qweight, qzeros


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes = unpack_rows(qweight.T.contiguous(), 4, AWQ_ORDER)  # [N, K]
    zeros = unpack_rows(qzeros.T.contiguous(), 4, AWQ_ORDER).T.contiguous()  # [G, N]
    return codes, zeros


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    codes, zeros = unpack_awq(qweight, qzeros)
    g = torch.arange(codes.shape[1]) // group_size
    return (codes.float() - zeros.T[:, g].float()) * scales.float().T[:, g]
