"""labkit.kv: paged KV memory.

- ``block_pool.BlockPool``: physical blocks, ref counts, free list, LRU of cached free blocks.
- ``prefix``: chained sha256 block hashes for prefix caching.
- ``block_manager.BlockManager``: block tables, prefix hits, copy-on-write, swap, rollback.
- ``cache.PagedKVCache``: per-layer ``[num_blocks, block_size, Hkv, D]`` tensors, ``attend``.
- ``attention``: the AttentionBackend protocol and the PyTorch reference paged attention.
"""
