"""KV cache groups: which layers may drop old blocks, and how much memory each group needs.

A sliding-window layer with window ``w`` only ever reads the last ``w`` keys, yet a paged cache
that treats it like full attention keeps every block of the sequence. vLLM's hybrid KV cache
manager groups the layers by attention type (full, sliding ``w``, latent) and lets each group
drop the blocks its future queries can no longer see.

The freeing rule, from the attention mask. A query at position ``q`` sees key ``k`` iff
``q - w < k <= q`` (``_decode_mask``/``_prefill_plan`` in :mod:`labkit.kv.attention`). Once
``n = num_computed_tokens`` tokens have KV, every future query has ``q >= n``, so key ``k`` is
dead iff ``k <= n - w``. Block ``b`` holds keys ``[b*bs, (b+1)*bs)``; it is dead iff its last
key ``(b+1)*bs - 1 <= n - w``, i.e. ``(b+1)*bs <= n - w + 1``. So the first
``max(0, (n - w + 1) // bs)`` blocks can be freed (:func:`num_skipped_blocks`); the block
table keeps :data:`NULL_BLOCK` in their place, so key position ``p`` still sits in logical
block ``p // bs``.

One pool, one table per sequence: labkit's block manager frees only when *every* layer slides
with the same window (Mistral; :func:`freeable_window`). A mixed model (Gemma 3: 5 sliding to 1
full; gpt-oss: alternating) shares one block id across all its layers, and a full layer still
needs every block, so no block can be freed. Freeing the sliding layers' memory there needs one
block table per group over one shared pool (vLLM's ``KVCacheCoordinator`` with a
``SingleTypeKVCacheManager`` per group, each group's tensors sized by its own layers). That is
not built here; :func:`group_kv_bytes` reports what it would save, per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.kv.cache import kv_bytes_per_block
from labkit.model.layers import layer_kv_latent_dims, layer_sliding_windows
from labkit.utils import cdiv

NULL_BLOCK = -1  # a freed (outside-the-window) entry of a block table; never a physical block

__all__ = ["NULL_BLOCK", "KVCacheGroup", "freeable_window", "group_kv_bytes",
           "kv_cache_groups", "num_skipped_blocks", "peak_blocks"]


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share an attention type: ``kind`` is "full", "sliding" or "mla"."""

    kind: str
    sliding_window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"sliding_{self.sliding_window}" if self.kind == "sliding" else self.kind


def kv_cache_groups(config: object) -> list[KVCacheGroup]:
    """The model's layers grouped by attention type, in order of first appearance."""
    windows, latent = layer_sliding_windows(config), layer_kv_latent_dims(config)
    groups: dict[tuple, list[int]] = {}
    for i, (w, lat) in enumerate(zip(windows, latent)):
        key = ("mla", None) if lat is not None else ("full", None) if w is None \
            else ("sliding", w)
        groups.setdefault(key, []).append(i)
    return [KVCacheGroup(k, w, tuple(ls)) for (k, w), ls in groups.items()]


def freeable_window(config: object) -> int | None:
    """The window the block manager may free blocks outside: every layer slides with this one
    window. None when any layer attends fully (or by latent), or windows differ: one block
    table serves all layers, so a block is dead only when it is dead for every layer."""
    groups = kv_cache_groups(config)
    if len(groups) == 1 and groups[0].kind == "sliding":
        return groups[0].sliding_window
    return None


def num_skipped_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks no query at position >= ``num_computed_tokens`` can see (module doc)."""
    return max(0, (num_computed_tokens - window + 1) // block_size)


def peak_blocks(num_tokens: int, block_size: int, window: int | None = None) -> int:
    """Most blocks one sequence of ``num_tokens`` holds at once: all of them for full
    attention; with freeing, the max over each step's allocation (position ``n`` being written,
    ``n`` tokens computed) of the blocks allocated minus those skipped. That is decoding one
    token a step; a prompt prefilled in one chunk holds all its blocks until the next step
    frees the dead ones (chunked prefill keeps the peak near this)."""
    if window is None:
        return cdiv(num_tokens, block_size)
    return max((cdiv(n + 1, block_size) - num_skipped_blocks(n, window, block_size)
                for n in range(num_tokens)), default=0)


def group_kv_bytes(config: object, num_tokens: int, block_size: int, dtype: torch.dtype,
                   free_outside_window: bool) -> dict[str, int]:
    """Bytes of KV one request of ``num_tokens`` needs, per group (at its peak). Without
    freeing every group holds every block; with it a sliding group holds
    :func:`peak_blocks` with its window (what per-group tables would give a mixed model)."""
    out: dict[str, int] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for g in kv_cache_groups(config):
        if g.kind == "mla":
            width = config.mla.latent_dim
            per_block = len(g.layers) * block_size * width * elem
        else:
            per_block = kv_bytes_per_block(len(g.layers), block_size, config.num_key_value_heads,
                                           config.head_dim, dtype)
        window = g.sliding_window if free_outside_window else None
        out[g.name] = per_block * peak_blocks(num_tokens, block_size, window)
    return out
