"""Reference solutions of the MLA / sliding-window exercise (read only by ``inject``, the
checker's named-mistake variants and the tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cache_entry(c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                rope: Callable) -> torch.Tensor:
    return torch.cat([c, rope(k_pe, positions)], dim=-1)


def absorbed_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    C = w_uk.shape[-1]
    c, k_pe = cache[:, :C], cache[:, C:]
    q_lat = torch.einsum("hd,hdc->hc", q_nope, w_uk)  # W_UK folded into the query
    scores = (q_lat @ c.T + q_pe @ k_pe.T) * scale  # [H, S]
    o_lat = scores.softmax(dim=-1) @ c  # [H, C]: attention in latent space
    return torch.einsum("hc,hvc->hv", o_lat, w_uv)  # W_UV applied once, after


def freeable_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    first_needed = num_computed_tokens - window + 1  # the next query's first key
    return max(first_needed, 0) // block_size
