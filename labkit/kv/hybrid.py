"""KV cache groups: which layers may drop old blocks, and how much memory each group needs.

A sliding-window layer with window ``w`` only ever reads the last ``w`` keys, yet a paged cache
that treats it like full attention keeps every block of the sequence. vLLM's hybrid KV cache
manager groups the layers by attention type (full, sliding ``w``, latent) and lets each group
drop the blocks its future queries can no longer see.

The freeing rule, from the attention mask. A query at position ``q`` sees key ``k`` iff
``q - w < k <= q`` (``decode_mask``/``_prefill_plan`` in :mod:`labkit.kv.attention`). Once
``n = num_computed_tokens`` tokens have KV, every future query has ``q >= n``, so key ``k`` is
dead iff ``k <= n - w``. Block ``b`` holds keys ``[b*bs, (b+1)*bs)``; it is dead iff its last
key ``(b+1)*bs - 1 <= n - w``, i.e. ``(b+1)*bs <= n - w + 1``. So the first
``max(0, (n - w + 1) // bs)`` blocks can be freed (:func:`num_skipped_blocks`); the block
table keeps :data:`NULL_BLOCK` in their place, so key position ``p`` still sits in logical
block ``p // bs``.

One table per sequence (:class:`~labkit.kv.block_manager.BlockManager`) frees only when
*every* layer slides with the same window (Mistral; :func:`freeable_window`): a block id then
stands for the same positions in all layers, and a full layer needs every block. A mixed model
(Gemma 3: 5 sliding to 1 full; gpt-oss: alternating) needs one block table per group over one
shared pool, as vLLM's hybrid manager (``KVCacheCoordinator`` with one
``SingleTypeKVCacheManager`` per group) does: :func:`hybrid_layout` splits the layers into
groups of equal size ``S`` (the gcd of the type counts), and :mod:`labkit.kv.hybrid_manager`
gives each group its own tables. A block id then holds ``S`` layers' K/V, and layer ``j`` of
every group writes into the same tensor ``j`` (:class:`HybridLayout`): a block belongs to one
group at a time, so the groups never collide, and a freed sliding block can serve the full
group next. :func:`group_kv_bytes` reports what that saves, per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import torch

from labkit.model.layers import layer_kv_latent_dims, layer_sliding_windows
from labkit.utils import cdiv

NULL_BLOCK = -1  # a freed (outside-the-window) entry of a block table; never a physical block

__all__ = ["NULL_BLOCK", "HybridLayout", "KVCacheGroup", "freeable_window", "group_kv_bytes",
           "hit_blocks", "hybrid_layout", "kv_cache_groups", "max_blocks_held",
           "num_skipped_blocks",
           "peak_blocks"]


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


@dataclass(frozen=True)
class HybridLayout:
    """Groups of equal size for per-group block tables: ``layer_group[i]`` is layer i's group
    (its block table), ``layer_tensor[i]`` the KV tensor it shares with the layers at the same
    place in the other groups; ``len(groups[0].layers)`` tensors in all."""

    groups: tuple[KVCacheGroup, ...]
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.groups[0].layers)


def hybrid_layout(config: object) -> HybridLayout | None:
    """The per-group layout of a model that mixes sliding-window and full layers, or None
    (one group, or latent layers: one block table serves them). Gemma 3's 5:1 gives groups of
    one layer (six tables: five sliding, one full); gpt-oss's 1:1 two groups of half the
    layers. Splitting a type into several groups of one window costs more tables but lets
    every block id mean the same bytes (vLLM splits the same way)."""
    groups = kv_cache_groups(config)
    if len(groups) < 2 or any(g.kind == "mla" for g in groups) \
            or not any(g.kind == "sliding" for g in groups):
        return None
    size = gcd(*(len(g.layers) for g in groups))
    split = tuple(KVCacheGroup(g.kind, g.sliding_window, g.layers[i:i + size])
                  for g in groups for i in range(0, len(g.layers), size))
    n = sum(len(g.layers) for g in split)
    layer_group, layer_tensor = [0] * n, [0] * n
    for gi, g in enumerate(split):
        for j, layer in enumerate(g.layers):
            layer_group[layer], layer_tensor[layer] = gi, j
    return HybridLayout(split, tuple(layer_group), tuple(layer_tensor))


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


def hit_blocks(found: list[int | None], k: int, window: int | None, block_size: int
               ) -> list[int] | None:
    """The blocks a prefix hit of ``k`` blocks takes, or None if it cannot: ``found[i]`` is
    the cached block of the prompt's block ``i`` (None: not cached). Full attention needs all
    ``k``; a sliding window only those its next query still sees, the dead ones
    (:func:`num_skipped_blocks` with ``k * block_size`` tokens computed) come back as
    :data:`NULL_BLOCK` (vLLM's ``SlidingWindowManager.find_longest_cache_hit``)."""
    dead = 0 if window is None else min(num_skipped_blocks(k * block_size, window, block_size),
                                        k)
    live = found[dead:k]
    if len(live) < k - dead or any(b is None for b in live):
        return None
    return [NULL_BLOCK] * dead + live


def max_blocks_held(num_tokens: int, block_size: int, window: int | None = None,
                    chunk: int | None = None) -> int:
    """An upper bound on the blocks one sequence of ``num_tokens`` holds at once when each
    step writes at most ``chunk`` tokens (what admission checks against the pool). Full
    attention: all of them. A sliding window ``w``: a step writing ``c`` tokens after ``n``
    computed holds ``cdiv(n + c, bs) - (n - w + 1) // bs`` blocks (the rest are freed first),
    at most ``(c + w - 1) // bs + 2``."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, ((chunk or num_tokens) + window - 1) // block_size + 2)


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
            per_block = (2 * len(g.layers) * block_size * config.num_key_value_heads
                         * config.head_dim * elem)  # K and V (kv.cache.kv_bytes_per_block)
        window = g.sliding_window if free_outside_window else None
        out[g.name] = per_block * peak_blocks(num_tokens, block_size, window)
    return out
