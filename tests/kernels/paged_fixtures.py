"""Random paged-KV fixtures shared by the attention tests (scattered blocks, ragged lengths)."""

from __future__ import annotations

import torch

# Tolerances (max abs error vs an fp32 reference on O(1) values). bf16 is loose because the
# interpreter rounds fp32 -> bf16 toward zero (1 ulp = 2^-7 relative) where a GPU rounds to nearest.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_paged(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int, spare_blocks: int = 3):
    """Caches with each sequence's blocks at random physical places; rows padded with 0."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(per_seq) + 1  # one extra padded column, as the engine pads rows
    block_tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), g
