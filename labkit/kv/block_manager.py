"""BlockManager: maps each sequence's logical blocks to physical ones (its block table).

It owns the GPU BlockPool (and an optional CPU pool for swapping) and implements the policies the
scheduler asks for: how many blocks a step needs, prefix-cache lookups, copy-on-write after a
fork, swap out / in, and rolling a sequence back (speculative decoding rejects tokens).

Every change to a block table is also appended to ``self.events`` (the trace's block events), so
the state at any step can be rebuilt by folding the events (labkit.engine.trace.replay).

Tensor work is *not* done here: copy-on-write and swaps are queued in ``pending_copies``,
``pending_swap_out`` and ``pending_swap_in`` and the executor applies them before the forward
pass. That keeps this module usable by the simulator, which has no tensors at all.

Sequences are duck-typed (see ``SeqLike``): the scheduler's Sequence, or a small test double.

Sliding windows (``sliding_window=w``, set when every layer of the model slides with window
``w``: :func:`labkit.kv.hybrid.freeable_window`): each ``allocate_slots`` first frees the
leading blocks no future query can see (``remove_skipped_blocks``, vLLM's name; the rule is
derived in :mod:`labkit.kv.hybrid`) and leaves ``NULL_BLOCK`` (-1) in their table entries, so
logical block ``p // block_size`` still holds position ``p``. The attention metadata maps -1 to
block 0, as it pads; the window mask gives those positions zero weight, so what block 0 holds
is never used. Every walk over a table here skips -1. A prefix hit needs only the blocks its
window still sees (vLLM's ``SlidingWindowManager.find_longest_cache_hit``): the blocks before
them may have been evicted and come back as -1 (``_window_hit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from labkit.config import CacheConfig
from labkit.kv.block_pool import BlockPool
from labkit.kv.hybrid import NULL_BLOCK, hit_blocks, num_skipped_blocks
from labkit.kv.prefix import BlockHash, hash_block_tokens, hash_prompt_blocks
from labkit.utils import cdiv

__all__ = ["BlockManager", "BlockOps", "SeqLike", "cdiv"]


class SeqLike(Protocol):
    seq_id: str
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    cpu_block_table: list[int]
    block_hashes: list[BlockHash]
    cache_salt: str | None
    # optional: ``lora_int_id`` (int | None), the request's adapter, a prefix-cache key part;
    # read with getattr so test doubles without it stay base-model sequences


def _lora_id(seq: SeqLike) -> int | None:
    return getattr(seq, "lora_int_id", None)


@dataclass
class BlockOps:
    """The tensor copies one step's block decisions need, applied by the executor before the
    forward: copy-on-write ``(src, dst)``, swap out ``(gpu, cpu)``, swap in ``(cpu, gpu)``."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        kv_group: int | None = None,
    ) -> None:
        # the one place pool settings are checked (EngineConfigError, a ValueError)
        CacheConfig(block_size, num_blocks, num_cpu_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # pool/kv_group: one group of labkit.kv.hybrid_manager (a shared pool, its own keys)
        self.pool = pool or BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.kv_group = kv_group
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.seqs: dict[str, SeqLike] = {}  # sequences holding GPU blocks
        self.events: list[dict] = []
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write
        self.pending_swap_out: list[tuple[int, int]] = []  # (gpu, cpu)
        self.pending_swap_in: list[tuple[int, int]] = []  # (cpu, gpu)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # a prefix-cache key part: the weights' version after a hot update (None before any);
        # ``version_in_key=False`` only to show the stale-KV bug (labkit.engine.weight_update)
        self.weight_version: str | None = None
        self.version_in_key = True
        self.used_weight_versions: set[str] = set()  # a version is used once
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
        self.sliding_window = sliding_window  # free blocks outside it (None: keep all)
        self.num_window_freed = 0  # blocks freed because no future query can see them

    @property
    def key_version(self) -> str | None:
        """The weight version the prefix-cache keys carry (None: none, the original keys)."""
        return self.weight_version if self.version_in_key else None

    @classmethod
    def from_config(cls, cache: CacheConfig, sliding_window: int | None = None
                    ) -> BlockManager:
        return cls(cache.num_blocks, cache.block_size, cache.enable_prefix_caching,
                   cache.num_cpu_blocks, sliding_window)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def _ev(self, type_: str, seq: SeqLike, logical: int, physical: int, src=None, **kw) -> None:
        ev = {"type": type_, "request_id": seq.request_id, "seq_id": seq.seq_id,
              "logical": logical, "physical": physical, "src": src}
        if kw:
            ev.update(kw)
        self.events.append(ev)

    def take_block_ops(self) -> BlockOps:
        """Hand the executor the tensor copies queued since the last call."""
        ops = BlockOps(self.pending_copies, self.pending_swap_out, self.pending_swap_in)
        self.pending_copies, self.pending_swap_out, self.pending_swap_in = [], [], []
        return ops

    def take_events(self) -> list[dict]:
        """Hand the trace the block events since the last call."""
        events, self.events = self.events, []
        return events

    def drain(self) -> tuple[list[dict], list, list, list]:
        """Both at once: (events, copies, swap_out, swap_in)."""
        ops = self.take_block_ops()
        return self.take_events(), ops.copies, ops.swap_out, ops.swap_in

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: SeqLike) -> tuple[list[int], list[BlockHash]]:
        """Longest chain of cached full blocks for a sequence that has nothing computed yet.

        At most (num_tokens - 1) tokens may hit: the last token is always recomputed so the step
        produces logits to sample from. A fully cached, block-aligned prompt therefore reuses all
        blocks but the last, which is recomputed into a fresh block (as vLLM does). A sequence
        with ``skip_reading_prefix_cache`` (prompt logprobs) gets no hit."""
        if not self.enable_prefix_caching or seq.num_computed_tokens \
                or getattr(seq, "skip_reading_prefix_cache", False):
            return [], []
        n = len(seq.token_ids) - 1
        hashes = hash_prompt_blocks(seq.token_ids[: n - n % self.block_size], self.block_size,
                                    seq.cache_salt, lora_int_id=_lora_id(seq),
                                    weight_version=self.key_version, kv_group=self.kv_group)
        if self.sliding_window is not None:
            return self._window_hit(hashes)
        blocks: list[int] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, hashes[: len(blocks)]

    def _window_hit(self, hashes: list[BlockHash]) -> tuple[list[int], list[BlockHash]]:
        """The longest hit of ``k`` blocks whose live part is cached (:func:`hit_blocks`).
        Root blocks, freed first and so evicted first, are not needed."""
        found = [self.pool.lookup(h) for h in hashes]
        for k in range(len(hashes), 0, -1):
            blocks = hit_blocks(found, k, self.sliding_window, self.block_size)
            if blocks is not None:
                return blocks, hashes[:k]
        return [], []

    def cache_full_blocks(self, seq: SeqLike) -> None:
        """Register blocks whose every slot now holds computed KV under their chained hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids), len(seq.block_table) * bs) // bs
        hashes = seq.block_hashes
        if len(hashes) >= num_full:
            return
        tokens, table = seq.token_ids, seq.block_table
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], seq.cache_salt,
                                       _lora_id(seq), self.key_version, self.kv_group)
            hashes.append(parent)
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], parent)

    # ---- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, seq: SeqLike, num_new_tokens: int, num_cached_blocks: int = 0,
                          num_lookahead: int = 0) -> int:
        total = (seq.num_computed_tokens + num_cached_blocks * self.block_size
                 + num_new_tokens + num_lookahead)
        need = cdiv(total, self.block_size) - len(seq.block_table) - num_cached_blocks
        return max(need, 0) + len(self._cow_blocks(seq, num_new_tokens + num_lookahead))

    def _cow_blocks(self, seq: SeqLike, num_slots: int) -> list[int]:
        """Logical blocks of the write range [computed, computed + num_slots) that are already
        allocated but shared (fork) or published in the prefix cache (possible after a rollback
        into a full block): writing there would corrupt the other holders, so each is copied
        first. The range can span several blocks (a chunk, or a verify pass writing into
        lookahead blocks a fork shares)."""
        table, bs, pool = seq.block_table, self.block_size, self.pool
        start = seq.num_computed_tokens
        hi = min(len(table), cdiv(start + num_slots, bs))
        return [i for i in range(start // bs, hi)
                if pool.ref_counts[table[i]] > 1 or pool.block_hash[table[i]] is not None]

    def allocate_slots(self, seq: SeqLike, num_new_tokens: int,
                       cached_blocks: list[int] | None = None,
                       cached_hashes: list[BlockHash] | None = None,
                       num_lookahead: int = 0) -> bool:
        """Make room for ``num_new_tokens`` (+ lookahead) more KV slots; False if the pool is short.

        ``cached_blocks`` are prefix-cache hits from find_cached_prefix (only for a sequence with
        nothing computed); picking them up may take them out of the evictable set, which the
        availability check accounts for."""
        table = seq.block_table
        bs = self.block_size
        self.remove_skipped_blocks(seq)
        if not cached_blocks:  # fast path: a decode step whose slot is already allocated
            start = seq.num_computed_tokens
            if start + num_new_tokens + num_lookahead <= len(table) * bs and \
                    not self._cow_blocks(seq, num_new_tokens + num_lookahead):
                return True
        cached_blocks = cached_blocks or []
        pool = self.pool
        need = self.num_blocks_needed(seq, num_new_tokens, len(cached_blocks), num_lookahead)
        reclaimed = sum(1 for b in cached_blocks if b != NULL_BLOCK and pool.ref_counts[b] == 0)
        if need > pool.num_available - reclaimed:
            return False
        fresh = not table and seq.num_computed_tokens == 0
        if fresh:
            self.seqs[seq.seq_id] = seq
            if self.enable_prefix_caching:
                self.prefix_query_tokens += len(seq.token_ids)
                self.prefix_hit_tokens += len(cached_blocks) * self.block_size
        for b in cached_blocks:
            if b != NULL_BLOCK:  # a window hit's dead blocks stay unheld
                pool.touch(b)
                self._ev("prefix_hit", seq, len(table), b)
            table.append(b)
        if cached_blocks:
            seq.block_hashes = list(cached_hashes or [])
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
        need_after = need
        for i in self._cow_blocks(seq, num_new_tokens + num_lookahead):
            src = table[i]
            dst = self._alloc(seq, i, event=False)
            self.pending_copies.append((src, dst))
            self._ev("cow", seq, i, dst, src)
            pool.free(src)
            table[i] = dst
            need_after -= 1
        for _ in range(need_after):
            self._alloc(seq, len(table))
        return True

    def remove_skipped_blocks(self, seq: SeqLike) -> int:
        """Free the leading blocks outside the sliding window of every query still to come
        (``(b+1) * block_size <= num_computed_tokens - window + 1``) and put NULL_BLOCK in their
        table entries; returns how many were freed now. Nothing without a window."""
        if self.sliding_window is None:
            return 0
        table = seq.block_table
        dead = min(num_skipped_blocks(seq.num_computed_tokens, self.sliding_window,
                                      self.block_size), len(table))
        freed = 0
        for i in range(dead - 1, -1, -1):  # tail first, as free(): the LRU keeps a chain's root
            if table[i] == NULL_BLOCK:
                break  # everything before it was freed by an earlier call
            cached = self.pool.free(table[i])
            self._ev("free", seq, i, table[i], None, cached=cached)
            table[i] = NULL_BLOCK
            freed += 1
        self.num_window_freed += freed
        return freed

    def _alloc(self, seq: SeqLike, logical: int, event: bool = True) -> int:
        b, evicted = self.pool.allocate()
        if evicted is not None:
            self._ev("evict", seq, logical, evicted)
        if event:
            self._ev("alloc", seq, logical, b)
            seq.block_table.append(b)
        return b

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """Child shares all of parent's blocks (ref counts +1); writes diverge via copy-on-write."""
        child.block_table = []
        for i, b in enumerate(parent.block_table):
            if b != NULL_BLOCK:
                self.pool.touch(b)
                self._ev("fork", child, i, b, None)
            child.block_table.append(b)
        child.block_hashes = list(parent.block_hashes)
        self.seqs[child.seq_id] = child

    def free(self, seq: SeqLike) -> None:
        """Release every block of a sequence (finish, abort, recompute preemption).
        Tail first, so the prefix cache's LRU evicts a chain from its end."""
        table = seq.block_table
        self._free_table(seq)
        table.clear()
        seq.block_hashes = []
        for i, c in enumerate(seq.cpu_block_table):  # aborted while swapped out
            if c == NULL_BLOCK:
                continue
            self.cpu_pool.free(c)
            self._ev("swap_free", seq, i, c)  # so a trace replay drops its CPU blocks too
        seq.cpu_block_table = []
        self.seqs.pop(seq.seq_id, None)

    def _free_table(self, seq: SeqLike) -> None:
        """Drop one reference to each block of the table (tail first), skipping NULL_BLOCK."""
        table = seq.block_table
        for i in range(len(table) - 1, -1, -1):
            if table[i] != NULL_BLOCK:
                cached = self.pool.free(table[i])
                self._ev("free", seq, i, table[i], None, cached=cached)

    def truncate(self, seq: SeqLike, num_slots: int) -> None:
        """Keep only the blocks covering the first ``num_slots`` slots (speculative rollback)."""
        keep = cdiv(num_slots, self.block_size)
        table = seq.block_table
        while len(table) > keep:
            i = len(table) - 1
            cached = self.pool.free(table[i])
            self._ev("free", seq, i, table[i], None, cached=cached)
            table.pop()
        del seq.block_hashes[num_slots // self.block_size:]

    # ---- swapping -----------------------------------------------------------------------------
    def can_swap_out(self, seq: SeqLike) -> bool:
        held = sum(b != NULL_BLOCK for b in seq.block_table)
        return 0 < held <= self.cpu_pool.num_available

    def swap_out(self, seq: SeqLike) -> None:
        """Copy a sequence's blocks to the CPU pool and free them on the GPU."""
        table = seq.block_table
        seq.cpu_block_table = []
        for i, b in enumerate(table):
            if b == NULL_BLOCK:  # outside the window: nothing to keep
                seq.cpu_block_table.append(NULL_BLOCK)
                continue
            c, _ = self.cpu_pool.allocate()
            self.pending_swap_out.append((b, c))
            self._ev("swap_out", seq, i, c, b)
            seq.cpu_block_table.append(c)
        self._free_table(seq)
        table.clear()
        seq.block_hashes = []

    def can_swap_in(self, seq: SeqLike, num_lookahead: int = 0) -> bool:
        nulls = seq.cpu_block_table.count(NULL_BLOCK)  # freed outside the window: stay freed
        need = cdiv(seq.num_computed_tokens + 1 + num_lookahead, self.block_size) - nulls
        return max(need, len(seq.cpu_block_table) - nulls) <= self.pool.num_available

    def swap_in(self, seq: SeqLike) -> None:
        for i, c in enumerate(seq.cpu_block_table):
            if c == NULL_BLOCK:
                seq.block_table.append(NULL_BLOCK)
                continue
            g = self._alloc(seq, i)
            self.pending_swap_in.append((c, g))
            self._ev("swap_in", seq, i, g, c)
            self.cpu_pool.free(c)
        seq.cpu_block_table = []
        self.seqs[seq.seq_id] = seq

    # ---- statistics ---------------------------------------------------------------------------
    def token_slots_used(self) -> int:
        """Slots holding a token's KV (shared blocks counted once per holder's view)."""
        bs = self.block_size
        return sum(min(s.num_computed_tokens, len(s.block_table) * bs)
                   - bs * s.block_table.count(NULL_BLOCK) for s in self.seqs.values())

    def stats(self) -> dict:
        p = self.pool
        used_slots = p.num_used * self.block_size
        filled = min(self.token_slots_used(), used_slots)
        return {
            "num_blocks": p.num_blocks, "num_used_blocks": p.num_used,
            "num_free_blocks": p.num_free, "num_cached_blocks": p.num_cached,
            "num_cpu_blocks": self.cpu_pool.num_blocks,
            "num_free_cpu_blocks": self.cpu_pool.num_available,
            "token_slots_used": filled, "internal_waste_slots": used_slots - filled,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / max(self.prefix_query_tokens, 1),
            "num_evictions": p.num_evictions,
            "num_window_freed_blocks": self.num_window_freed,
        }
