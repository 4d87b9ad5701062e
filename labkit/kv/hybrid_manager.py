"""KVCacheCoordinator: one block table per KV cache group over one shared pool (vLLM's hybrid
KV cache manager), for models that mix sliding-window and full layers (gpt-oss, Gemma 3).

Each group of :func:`labkit.kv.hybrid.hybrid_layout` gets its own :class:`BlockManager` (vLLM's
``SingleTypeKVCacheManager``): the sliding ones free blocks that fall out of their window, the
full one keeps every block. All of them allocate from one :class:`BlockPool`, so a block a
sliding group frees can hold the full group's next token. The scheduler sees the same interface
as a single BlockManager: this class answers for all groups at once, and a step either gets the
blocks of every group or of none.

How a sequence carries several tables: group 0 uses the sequence's own ``block_table`` (so
everything that reads it keeps working, and shows group 0); group g >= 1 works on a
:class:`GroupView` of the sequence (``seq.kv_group_views[g - 1]``) with its own table, hashes
and id ``"<seq_id>/g<g>"``. The views share the sequence's tokens and computed count. Block
events of group g carry the view's id, so a trace replay rebuilds one table per group.

Prefix caching: every group caches the same token blocks under its own keys (``kv_group`` in
the hash); a hit is the longest ``k`` blocks that *every* group can take (a full group needs
all ``k`` cached, a sliding group only the blocks its window still sees: :func:`hit_blocks`).

Not here: swapping (``can_swap_out`` is False, so a preempted sequence is recomputed, as when
the CPU pool is full); the engine does not build this manager with speculative decoding, a KV
connector or tensor-parallel workers (they read one table per sequence:
:func:`labkit.engine.model_setup.hybrid_kv_layout`).
"""

from __future__ import annotations

from typing import Any

from labkit.config import CacheConfig
from labkit.kv.block_manager import BlockManager, BlockOps, SeqLike
from labkit.kv.block_pool import BlockPool
from labkit.kv.hybrid import NULL_BLOCK, HybridLayout, hit_blocks
from labkit.kv.prefix import BlockHash, hash_prompt_blocks

__all__ = ["GroupView", "HybridHit", "KVCacheCoordinator", "group_block_tables"]


class GroupView:
    """A sequence as group ``g``'s manager sees it: its own table, swap table and hashes; the
    tokens, the computed count and the request's keys are the sequence's."""

    def __init__(self, seq: SeqLike, group: int) -> None:
        self.seq = seq
        self.seq_id = f"{seq.seq_id}/g{group}"
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self.seq.num_computed_tokens = n

    def __getattr__(self, name: str) -> Any:  # token_ids, request_id, cache_salt, ...
        return getattr(self.seq, name)


class HybridHit(list):
    """Group 0's prefix-hit blocks (what the scheduler counts), carrying every group's
    ``(blocks, hashes)`` for :meth:`KVCacheCoordinator.allocate_slots`."""

    per_group: list[tuple[list[int], list[BlockHash]]]


def group_block_tables(seq: Any) -> list[list[int]]:
    """Every group's block table of a sequence (one table when it has no views)."""
    return [seq.block_table, *(v.block_table for v in getattr(seq, "kv_group_views", ()))]


class KVCacheCoordinator:
    """The scheduler's block manager for a hybrid model (module doc)."""

    def __init__(self, cache: CacheConfig, layout: HybridLayout) -> None:
        self.layout = layout
        self.block_size = cache.block_size
        self.enable_prefix_caching = cache.enable_prefix_caching
        self.pool = BlockPool(cache.num_blocks, enable_caching=cache.enable_prefix_caching)
        self.cpu_pool = BlockPool(0, enable_caching=False)
        self.managers = [BlockManager(cache.num_blocks, cache.block_size,
                                      cache.enable_prefix_caching, 0, g.sliding_window,
                                      pool=self.pool, kv_group=i or None)
                         for i, g in enumerate(layout.groups)]
        # one event log and one queue of copies for all groups, in the order they happen
        self.events: list[dict] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []
        for m in self.managers:
            m.events, m.pending_copies = self.events, self.pending_copies
        self.seqs = self.managers[0].seqs  # the real sequences (group 0 holds them)
        self.sliding_window: int | None = None  # no single window: each group has its own

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_window_freed(self) -> int:
        return sum(m.num_window_freed for m in self.managers)

    # the weight version is a prefix-key part of every group
    def _set_all(self, name: str, value: Any) -> None:
        for m in self.managers:
            setattr(m, name, value)

    weight_version = property(lambda self: self.managers[0].weight_version,
                              lambda self, v: self._set_all("weight_version", v))
    version_in_key = property(lambda self: self.managers[0].version_in_key,
                              lambda self, v: self._set_all("version_in_key", v))
    used_weight_versions = property(lambda self: self.managers[0].used_weight_versions)

    def _views(self, seq: SeqLike) -> list[Any]:
        """``[seq, view 1, ...]``: what each group's manager works on (made on first use)."""
        views = getattr(seq, "kv_group_views", None)
        if views is None:
            views = [GroupView(seq, g) for g in range(1, len(self.managers))]
            seq.kv_group_views = views
        return [seq, *views]

    def _each(self, seq: SeqLike) -> list[tuple[BlockManager, Any]]:
        return list(zip(self.managers, self._views(seq)))

    # ---- the queues the executor and the trace drain -------------------------------------------
    def take_block_ops(self) -> BlockOps:
        ops = BlockOps(list(self.pending_copies), [], [])
        self.pending_copies.clear()
        return ops

    def take_events(self) -> list[dict]:
        events = list(self.events)
        self.events.clear()
        return events

    def drain(self) -> tuple[list[dict], list, list, list]:
        ops = self.take_block_ops()
        return self.take_events(), ops.copies, ops.swap_out, ops.swap_in

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: SeqLike) -> tuple[list[int], list[BlockHash]]:
        """The longest hit every group can take (module doc); group 0's blocks and hashes,
        every group's in the returned list's ``per_group``."""
        base = self.managers[0]
        if not self.enable_prefix_caching or seq.num_computed_tokens \
                or getattr(seq, "skip_reading_prefix_cache", False):
            return [], []
        n = len(seq.token_ids) - 1
        tokens, bs = seq.token_ids[: n - n % self.block_size], self.block_size
        hashes = [hash_prompt_blocks(tokens, bs, seq.cache_salt,
                                     lora_int_id=getattr(seq, "lora_int_id", None),
                                     weight_version=base.key_version, kv_group=m.kv_group)
                  for m in self.managers]
        found = [[self.pool.lookup(h) for h in hs] for hs in hashes]
        for k in range(len(hashes[0]), 0, -1):
            per = [hit_blocks(f, k, m.sliding_window, bs) for f, m in zip(found, self.managers)]
            if all(b is not None for b in per):
                hit = HybridHit(per[0])
                hit.per_group = [(b, hs[:k]) for b, hs in zip(per, hashes)]
                return hit, hashes[0][:k]
        return [], []

    def cache_full_blocks(self, seq: SeqLike) -> None:
        for m, v in self._each(seq):
            m.cache_full_blocks(v)

    # ---- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, seq: SeqLike, num_new_tokens: int, num_cached_blocks: int = 0,
                          num_lookahead: int = 0) -> int:
        return sum(m.num_blocks_needed(v, num_new_tokens, num_cached_blocks, num_lookahead)
                   for m, v in self._each(seq))

    def allocate_slots(self, seq: SeqLike, num_new_tokens: int,
                       cached_blocks: list[int] | None = None,
                       cached_hashes: list[BlockHash] | None = None,
                       num_lookahead: int = 0) -> bool:
        """Room in every group or in none: first each sliding group frees what its window
        lost, then the total need of all groups is checked against the pool at once."""
        pairs = self._each(seq)
        per = getattr(cached_blocks, "per_group", None) or [([], [])] * len(pairs)
        for m, v in pairs:
            m.remove_skipped_blocks(v)
        need = sum(m.num_blocks_needed(v, num_new_tokens, len(b), num_lookahead)
                   for (m, v), (b, _) in zip(pairs, per))
        reclaimed = len({b for blocks, _ in per for b in blocks
                         if b != NULL_BLOCK and self.pool.ref_counts[b] == 0})
        if need > self.pool.num_available - reclaimed:
            return False
        # pin every group's hit first: group 0's fresh blocks must not evict group 1's hit
        pinned = [b for blocks, _ in per for b in blocks if b != NULL_BLOCK]
        for b in pinned:
            self.pool.touch(b)
        start = seq.num_computed_tokens
        for (m, v), (blocks, hashes) in zip(pairs, per):
            seq.num_computed_tokens = start  # a hit moves it: each group counts from the start
            ok = m.allocate_slots(v, num_new_tokens, blocks, hashes, num_lookahead)
            assert ok, "the pool was checked for every group"  # labkit bug, not bad input
        for b in pinned:  # each is held by its table now; drop the pin (no event: net zero)
            self.pool.free(b)
        return True

    def remove_skipped_blocks(self, seq: SeqLike) -> int:
        return sum(m.remove_skipped_blocks(v) for m, v in self._each(seq))

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        for (m, p), (_, c) in zip(self._each(parent), self._each(child)):
            m.fork(p, c)

    def free(self, seq: SeqLike) -> None:
        for m, v in reversed(self._each(seq)):
            m.free(v)

    def truncate(self, seq: SeqLike, num_slots: int) -> None:
        for m, v in self._each(seq):
            m.truncate(v, num_slots)

    # ---- swapping: not built (preemption recomputes) -------------------------------------------
    def can_swap_out(self, seq: SeqLike) -> bool:
        return False

    def can_swap_in(self, seq: SeqLike, num_lookahead: int = 0) -> bool:
        return False

    def swap_out(self, seq: SeqLike) -> None:
        raise NotImplementedError("the hybrid KV manager recomputes preempted sequences; "
                                  "can_swap_out is always False")

    swap_in = swap_out

    # ---- statistics ---------------------------------------------------------------------------
    def token_slots_used(self) -> int:
        return sum(m.token_slots_used() for m in self.managers)

    def stats(self) -> dict:
        out = self.managers[0].stats()  # pool-wide counts (one pool) and group 0's prefix hits
        out["token_slots_used"] = min(self.token_slots_used(),
                                      self.pool.num_used * self.block_size)
        out["internal_waste_slots"] = self.pool.num_used * self.block_size \
            - out["token_slots_used"]
        out["num_window_freed_blocks"] = self.num_window_freed
        out["kv_cache_groups"] = [g.name for g in self.layout.groups]
        return out
