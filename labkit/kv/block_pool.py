"""BlockPool: the physical KV blocks, their reference counts and the prefix cache's LRU.

Every physical block is in exactly one of three states:
- **used**: ref_count > 0, held by at least one sequence's block table;
- **cached**: ref_count == 0 but its full contents are registered under a prefix hash, so a later
  request with the same prefix can pick it up without recomputing it;
- **free**: ref_count == 0 and holding nothing worth keeping.
used + cached + free == num_blocks always (the property tests check it every step).

Allocation takes a free block first and only then evicts the least recently freed cached block:
cached blocks are not "used" memory, they are an opportunistic cache that costs nothing to keep
until the pool is actually short. Freeing appends to the most-recently-used end, so a request's
blocks freed tail-first (as the block manager does) keep the chain's root longest; a root block
is what the most future prompts can share.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from labkit.kv.prefix import BlockHash


class BlockPoolError(RuntimeError):
    """An invariant was violated (double free, touching a free uncached block...): a bug."""


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when neither free nor evictable cached blocks remain."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self.hash_to_block: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        return len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids) - len(self.cached_free)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out right now (free + evictable cached)."""
        return len(self.free_ids) + len(self.cached_free)

    # ---- operations ---------------------------------------------------------------------------
    def allocate(self) -> tuple[int, int | None]:
        """Take a block (ref_count 1). Returns (block_id, evicted) where evicted is block_id when a
        cached block had to be evicted to make room, else None."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
            evicted = None
        elif self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            self._uncache(block_id)
            self.num_evictions += 1
            evicted = block_id
        else:
            raise NoFreeBlocksError("no free KV blocks left")
        self.ref_counts[block_id] = 1
        return block_id, evicted

    def touch(self, block_id: int) -> None:
        """Add a reference to a block that is used or cached (prefix hit, fork)."""
        rc = self.ref_counts[block_id]
        if rc == 0:
            if block_id not in self.cached_free:
                raise BlockPoolError(f"block {block_id} is free and uncached; cannot share it")
            del self.cached_free[block_id]
        self.ref_counts[block_id] = rc + 1

    def free(self, block_id: int) -> bool:
        """Drop one reference. Returns True when the block is now (or still) kept in the prefix
        cache, i.e. it ended in the cached state or is still used."""
        rc = self.ref_counts[block_id]
        if rc <= 0:
            raise BlockPoolError(f"double free of block {block_id}")
        self.ref_counts[block_id] = rc - 1
        if rc > 1:
            return True
        if self.block_hash[block_id] is not None:
            self.cached_free[block_id] = None
            return True
        self.free_ids.append(block_id)
        return False

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full block under its prefix hash. A second block with the same contents (two
        requests computed the same prefix at once) stays private: one copy is enough."""
        if not self.enable_caching or block_hash in self.hash_to_block:
            return False
        if self.block_hash[block_id] is not None:
            return False
        self.block_hash[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        return True

    def _uncache(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached (ref 0) block; used blocks keep their hashes."""
        while self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            self._uncache(block_id)
            self.free_ids.append(block_id)
