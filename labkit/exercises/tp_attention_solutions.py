"""Reference solutions of exercise 12 (tensor-parallel attention), injected by CI.

Written out from the contracts; the checker compares them (and learners' code) with
``labkit.parallel.plan`` / ``labkit.parallel.shard`` and with the unsharded ``labkit`` block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shard_attention(weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                    head_dim: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    q_per_rank = num_heads // world
    q0 = rank * q_per_rank
    if num_kv_heads >= world:  # divide the KV heads like the query heads
        kv_per_rank = num_kv_heads // world
        kv0 = rank * kv_per_rank
    else:  # fewer KV heads than ranks: keep a copy of the one KV head my query heads read
        kv_per_rank = 1
        kv0 = q0 // (num_heads // num_kv_heads)
    q_rows = slice(q0 * head_dim, (q0 + q_per_rank) * head_dim)
    kv_rows = slice(kv0 * head_dim, (kv0 + kv_per_rank) * head_dim)
    out = {}
    for name, t in weights.items():
        module, kind = name.split(".")
        if module == "q_proj":
            out[name] = t[q_rows]
        elif module in ("k_proj", "v_proj"):
            out[name] = t[kv_rows]
        elif kind == "weight":  # o_proj: row-parallel, the input columns of my query heads
            out[name] = t[:, q_rows]
        else:  # o_proj.bias: whole, added once after the all-reduce
            out[name] = t
    return out


def attention_forward(x: torch.Tensor, shard: dict[str, torch.Tensor], attend,
                      all_reduce) -> torch.Tensor:
    q = F.linear(x, shard["q_proj.weight"], shard.get("q_proj.bias"))
    k = F.linear(x, shard["k_proj.weight"], shard.get("k_proj.bias"))
    v = F.linear(x, shard["v_proj.weight"], shard.get("v_proj.bias"))
    y = all_reduce(F.linear(attend(q, k, v), shard["o_proj.weight"]))
    if "o_proj.bias" in shard:
        y = y + shard["o_proj.bias"]
    return y
