"""The scheduler's half of the KV-connector contract (:mod:`labkit.kv.connector.base`).

At admission, after the device prefix cache matched ``num_hit`` tokens, the connector says how
many more it can load (:func:`external_tokens`); the scheduler allocates blocks for those and
for the tokens still to compute in one ``allocate_slots`` call, then hands the connector the
blocks meant for its tokens and counts those tokens as computed (:func:`commit_external`). The
answer is checked here because a wrong one is silent otherwise: a partial block would be
half garbage, and matching the last token would leave nothing to sample from.
"""

from __future__ import annotations

from typing import Any

from labkit.errors import KVConnectorError


def external_tokens(connector: Any, seq: Any, num_hit: int, block_size: int) -> int:
    """Tokens the connector will load after the ``num_hit`` prefix-cache tokens (0 without one):
    whole blocks, never the last token."""
    if connector is None:
        return 0
    n = connector.get_num_new_matched_tokens(seq, num_hit)
    if not isinstance(n, int) or n % block_size or not 0 <= n <= seq.num_tokens - 1 - num_hit:
        raise KVConnectorError(f"{seq.seq_id}: the connector matched {n!r} tokens after "
                               f"{num_hit} cached ones of {seq.num_tokens}; it may match whole "
                               f"blocks of {block_size} only, and never the last token")
    return n


def commit_external(connector: Any, seq: Any, num_ext: int, block_size: int) -> None:
    """``seq`` holds blocks for its computed tokens, then ``num_ext`` loaded ones: hand the
    connector exactly those blocks, in prefix order, and count the tokens as computed. Called
    after every admission, with 0 tokens too (as vLLM does), so the connector sees each one."""
    first = seq.num_computed_tokens // block_size
    blocks = seq.block_table[first:first + num_ext // block_size]
    connector.update_state_after_alloc(seq, blocks, num_ext)
    seq.num_computed_tokens += num_ext
