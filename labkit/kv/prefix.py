"""Prefix-cache keys: a chain of block hashes.

A full block of KV can be reused by another request only if *everything before it* is identical
too (attention at position p depends on all tokens <= p). So a block's key covers the whole prefix
cheaply by chaining: ``hash(parent_block_hash, this_block_token_ids, extra_keys)``. Two prompts
share block i's key exactly when they share tokens [0, (i+1)*block_size) and the extra keys.

Extra keys carry everything else that changes the KV for the same tokens. Here that is the
optional per-request ``cache_salt``: tenants with different salts never share cached blocks, so
one tenant cannot learn (by timing a prefix hit) what another tenant's prompt was. And the
request's LoRA adapter (``lora_int_id``, vLLM keys by the adapter too): an adapter on q/k/v
changes every K and V after the first layer, so the same tokens under two adapters (or an
adapter and the base model) are different KV; the same adapter shares as usual. And the
engine's weight version (``weight_version``, set by a hot update, :mod:`labkit.engine.
weight_update`): the same tokens under new weights are different KV, so blocks computed before
the swap never match a lookup after it (vLLM flushes the cache on a weight update instead).

Why sha256 over a stable byte encoding and not Python's ``hash()``:
- ``hash()`` of a tuple is 64-bit and not collision resistant. A collision here does not raise,
  it silently serves another prompt's KV: wrong output, and across tenants a data leak. Someone
  who controls prompts can search for 64-bit collisions; sha256 makes that infeasible (vLLM moved
  to sha256 for the same reason).
- ``hash()`` of str/bytes is salted per process (PYTHONHASHSEED), so keys would differ between
  runs; a stable encoding makes traces and tests reproducible across processes.
The encoding is fixed-width little-endian int64 token ids plus a length-prefixed salt, so no two
different inputs encode to the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"\x00" * 32  # parent of the first block


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora_int_id: int | None = None,
    weight_version: str | None = None,
    kv_group: int | None = None,
) -> BlockHash:
    """Key of one full block given its parent's key (None for the first block). Without an
    adapter, a weight version or a KV cache group the bytes hashed are exactly the old ones
    (keys stay stable across labkit versions). ``kv_group`` (the hybrid manager's groups
    after the first, :mod:`labkit.kv.hybrid_manager`): the same tokens are cached once per
    group, in different blocks of one pool, so each group needs its own keys."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else _ROOT)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        h.update(b"S" + struct.pack("<I", len(salt)) + salt)
    else:
        h.update(b"N")
    if lora_int_id is not None:
        h.update(b"L" + struct.pack("<q", lora_int_id))
    if weight_version is not None:
        v = weight_version.encode("utf-8")
        h.update(b"W" + struct.pack("<I", len(v)) + v)
    if kv_group is not None:
        h.update(b"G" + struct.pack("<q", kv_group))
    return h.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_hash: BlockHash | None = None,
    lora_int_id: int | None = None,
    weight_version: str | None = None,
    kv_group: int | None = None,
) -> list[BlockHash]:
    """Chained keys of every *full* block of ``token_ids`` (a partial tail block has no key)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent_hash = hash_block_tokens(parent_hash, block, cache_salt, lora_int_id,
                                        weight_version, kv_group)
        hashes.append(parent_hash)
    return hashes
