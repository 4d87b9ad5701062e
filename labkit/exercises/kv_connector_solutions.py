"""Reference solutions of the KV-connector exercise (read only by ``inject`` and the tests)."""

from __future__ import annotations

from collections.abc import Callable


def block_keys(token_ids: list[int], block_size: int, salt: str | None,
               hash_block: Callable) -> list:
    keys: list = []
    for i in range(len(token_ids) // block_size):
        keys.append(hash_block(keys[-1] if keys else None,
                               token_ids[i * block_size:(i + 1) * block_size], salt))
    return keys


def num_matched_tokens(keys: list, in_store: Callable, num_prompt_tokens: int,
                       num_computed_tokens: int, block_size: int) -> int:
    if num_computed_tokens % block_size:
        return 0
    last = (num_prompt_tokens - 1) // block_size  # blocks that leave the last token out
    n = 0
    for key in keys[num_computed_tokens // block_size:last]:
        if not in_store(key):
            break
        n += 1
    return n * block_size


def blocks_to_load(block_table: list[int], num_computed_tokens: int, num_external_tokens: int,
                   block_size: int) -> list[int]:
    first = num_computed_tokens // block_size
    return block_table[first:first + num_external_tokens // block_size]
