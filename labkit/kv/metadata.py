"""AttentionMetadata: what every attention layer of one step needs to know, built once per step.

A forward runs the same attention layout through every layer: the same slots, block tables,
query chunks and context lengths. Anything derived from them (host-side lengths, index tensors
for packing chunks, masks) is therefore per *step*, not per *layer*. The model runner builds this
object from Python lists it already has (so reading lengths never syncs with the device), and a
backend may park its own derived tensors in ``scratch`` the first time a layer asks, so the other
layers reuse them (vLLM's ``AttentionMetadataBuilder`` does the same job).
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


def build_attention_metadata(slots: list[int], block_tables: list[list[int]],
                             query_lens: list[int], context_lens: list[int],
                             device: torch.device | str) -> AttentionMetadata:
    """One step's metadata from host lists: ``query_lens[b]`` new tokens of sequence b end at
    position ``context_lens[b] - 1``; ``block_tables`` rows are padded with block 0."""
    if not (len(block_tables) == len(query_lens) == len(context_lens)):
        raise ValueError(f"{len(block_tables)} block tables, {len(query_lens)} query lengths, "
                         f"{len(context_lens)} context lengths: one of each per sequence")
    width = max((len(t) for t in block_tables), default=0)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                      device=device)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        decode_only=all(n == 1 for n in query_lens),
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
    )
