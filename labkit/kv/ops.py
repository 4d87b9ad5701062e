"""Reading K/V through block tables, and the INT8 KV codes: written once, used everywhere.

The torch attention backend, the kernels' plain-PyTorch references, the INT8 reference cache
(``labkit.quant.kv_int8``) and the kernel benchmark all need the same three operations, and a
second copy of any of them is a second place for the layout or the rounding to drift:

- :func:`gather_blocks`: ``[num_blocks, block_size, H, D]`` read through block tables ``[B, M]``
  as each sequence's keys in order, ``[B, M * block_size, H, D]`` (dequantized on the way for
  an INT8 cache, only the blocks read);
- :func:`quantize_kv_per_head` / :func:`dequantize_kv_per_head`: one fp16 scale per
  (token, head) = ``absmax / 127``; code = ``round(x / scale)`` clamped to +-127. An FP8 cache
  (``code_dtype=torch.float8_e4m3fn``) scales ``absmax`` to 448, e4m3's largest finite value,
  and rounds to e4m3's grid instead: the same bytes per element, but relative rather than
  absolute rounding error (3 mantissa bits: within 2^-4 of each value, small ones included).

This module imports only torch: the kernels (which sit beside ``labkit.kv``) may import it.
"""

from __future__ import annotations

import torch

KV_SCALE_DTYPE = torch.float16


FP8_KV_DTYPE = getattr(torch, "float8_e4m3fn", None)  # vLLM's kv_cache_dtype="fp8" (e4m3)
FP8_MAX = 448.0
# the smallest scale: fp16's smallest subnormal (2**-24). A lower floor (1e-8) rounds to 0 in
# fp16, and an all-zero (token, head) row then encodes 0 / 0 = NaN
KV_SCALE_MIN = 2.0 ** -24


def quantize_kv_per_head(x: torch.Tensor, code_dtype: torch.dtype = torch.int8
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, D] -> (codes [..., H, D], fp16 scale [..., H]); one scale per (token, head).
    ``code_dtype``: ``torch.int8`` (absmax -> 127, round) or ``torch.float8_e4m3fn`` (absmax ->
    448, e4m3's rounding)."""
    if code_dtype == torch.int8:
        scale = (x.float().abs().amax(dim=-1) / 127).clamp(min=KV_SCALE_MIN).to(KV_SCALE_DTYPE)
        q = torch.round(x.float() / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return q, scale
    if FP8_KV_DTYPE is None or code_dtype != FP8_KV_DTYPE:
        raise ValueError(f"KV codes are int8 or float8_e4m3fn, not {code_dtype}")
    scale = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=KV_SCALE_MIN).to(KV_SCALE_DTYPE)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(code_dtype)
    return q, scale


def dequantize_kv_per_head(q: torch.Tensor, scale: torch.Tensor | None,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., H, D] * scale [..., H] -> ``dtype``. ``scale=None`` (a float cache): ``q``
    unchanged, so callers need no branch."""
    if scale is None:
        return q
    return (q.float() * scale.float()[..., None]).to(dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  scale: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[num_blocks, bs, H, D] x block tables [B, M] (or one table [M]) -> [B, M*bs, H, D] (or
    [M*bs, H, D]): each sequence's K or V in position order. With an INT8 cache's per-(slot, head)
    ``scale`` [num_blocks, bs, H] the gathered blocks are dequantized to ``dtype``."""
    bt = block_tables.long()
    flat = bt.reshape(-1)  # index_select copies whole blocks; cache[bt] copies element-wise,
    g = cache.index_select(0, flat)  # about 4x slower at a decode batch's gather
    if scale is not None:
        g = dequantize_kv_per_head(g, scale.index_select(0, flat), dtype)
    return g.reshape(*bt.shape[:-1], bt.shape[-1] * cache.shape[1], *cache.shape[2:])
