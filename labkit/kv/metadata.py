"""AttentionMetadata: what every attention layer of one step needs to know, built once per step.

A forward runs the same attention layout through every layer: the same slots, block tables,
query chunks and context lengths. Anything derived from them (host-side lengths, index tensors
for packing chunks, masks) is therefore per *step*, not per *layer*. The model runner builds this
object from Python lists it already has (so reading lengths never syncs with the device), and a
backend may park its own derived tensors in ``scratch`` the first time a layer asks, so the other
layers reuse them (vLLM's ``AttentionMetadataBuilder`` does the same job). The builder is
``labkit.kv.cache.build_attention_metadata`` (``PagedKVCache.begin_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0-padded
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    decode_only: bool  # every sequence has exactly one new token
    # host copies (None when built from tensors only): chunk lengths and context lengths
    query_lens_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    max_query_len: int = 1
    max_context_len: int = 0
    # per-step tensors a backend derives on the first layer and reuses in the others
    scratch: dict[str, Any] = field(default_factory=dict)
