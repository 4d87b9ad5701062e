"""labkit.kv: paged KV memory -- the blocks, who holds them, and the tensors in them.

Sits above ``labkit.model`` and below the scheduler; imports no other labkit package but the
bottom (``labkit.config``, ``labkit.errors``, ``labkit.utils``).

- ``block_pool.BlockPool``: physical blocks, ref counts, free list, LRU of cached free blocks.
- ``prefix``: chained sha256 block hashes for prefix caching.
- ``block_manager.BlockManager``: block tables, prefix hits, copy-on-write, swap, rollback; it
  queues tensor copies as ``BlockOps`` for the executor and logs every change as a trace event.
- ``hybrid``: layers grouped by attention type (full / sliding / latent), the rule for freeing
  blocks outside a sliding window (``NULL_BLOCK`` placeholders) and bytes per group.
- ``cache.PagedKVCache``: per-layer ``[num_blocks, block_size, Hkv, D]`` tensors, the per-step
  ``AttentionMetadata`` (``metadata``) and the model's ``attend`` hook.
- ``attention``: the AttentionBackend protocol and the PyTorch reference paged attention;
  ``backends``: other backends by name (Triton, registered by ``labkit/__init__``).
- ``ops``: the one K/V gather through block tables and the one INT8 KV quantize / dequantize.
- ``connector``: the KV-connector contract (vLLM v1's scheduler / worker split) and the
  offloading connector, a tiered prefix cache (device -> CPU -> checksummed files on disk).
"""
