"""KV accounting invariants of a live engine, checkable at any step (tests, exercises, notebooks).

A paged KV cache fails quietly: a block whose ref count is one too high is never reused (the
pool shrinks until requests stall), one too low is handed to a second sequence while the first
still reads it (wrong tokens, no error). So the accounting is checked against an independent
recount from the sequences themselves, not against the pool's own counters:

- every GPU block's ref count equals the number of live block tables holding it, and every CPU
  (swap) block is held by exactly one swapped-out sequence;
- each block is in exactly one state: used (ref > 0), cached (ref 0, hashed) or free;
- finished sequences hold nothing.

``assert_no_leaks`` adds the end state the project promises after every scenario (finish, abort,
preemption, a failed step, speculative rollback): no request left, every block free or cached
with ref count 0, the swap space empty, no queued block copies.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from labkit.kv.hybrid_manager import group_block_tables


class KVInvariantError(AssertionError):
    """The engine's block accounting is inconsistent (a labkit bug, not bad input)."""


def _fail(msg: str) -> None:
    raise KVInvariantError(msg)


def check_kv_invariants(engine: Any) -> None:
    """Raise KVInvariantError if the pools disagree with the sequences' block tables."""
    bm = engine.block_manager
    pool, cpu = bm.pool, bm.cpu_pool
    gpu_holders: Counter[int] = Counter()
    cpu_holders: Counter[int] = Counter()
    for req in engine.requests.values():
        for s in req.seqs:
            tables = group_block_tables(s)  # one per KV cache group (hybrid), else one
            if s.is_finished:
                if any(tables) or s.cpu_block_table:
                    _fail(f"finished sequence {s.seq_id} still holds blocks "
                          f"{tables} / cpu {s.cpu_block_table}")
                continue
            gpu_holders.update(b for t in tables for b in t if b >= 0)  # -1: freed (window)
            cpu_holders.update(b for b in s.cpu_block_table if b >= 0)
    for b in range(pool.num_blocks):
        if pool.ref_counts[b] != gpu_holders[b]:
            _fail(f"block {b}: ref count {pool.ref_counts[b]} but {gpu_holders[b]} block tables "
                  "hold it")
    free, cached = list(pool.free_ids), list(pool.cached_free)
    if len(set(free)) != len(free) or set(free) & set(cached):
        _fail("a block is listed twice in the free list / cached LRU")
    for b in free + cached:
        if pool.ref_counts[b]:
            _fail(f"block {b} is free or cached but has ref count {pool.ref_counts[b]}")
    for b in cached:
        if pool.block_hash[b] is None:
            _fail(f"cached block {b} has no prefix hash")
    if sum(1 for r in pool.ref_counts if r > 0) + len(free) + len(cached) != pool.num_blocks:
        _fail("used + free + cached != total blocks")
    for h, b in pool.hash_to_block.items():
        if pool.block_hash[b] != h:
            _fail(f"prefix index points hash -> block {b}, which holds another hash")
    for b in range(cpu.num_blocks):
        if cpu.ref_counts[b] != cpu_holders[b] or cpu_holders[b] > 1:
            _fail(f"cpu block {b}: ref count {cpu.ref_counts[b]}, holders {cpu_holders[b]}")


def assert_no_leaks(engine: Any) -> None:
    """The engine is idle and holds nothing: every block free or cached (ref count 0), the
    swap space empty, no request queued, no block copy pending."""
    check_kv_invariants(engine)
    bm, sched = engine.block_manager, engine.scheduler
    if engine.has_unfinished_requests():
        _fail(f"requests still unfinished: {engine.stats()}")
    unfinished = [s.seq_id for r in engine.requests.values() for s in r.seqs
                  if not s.is_finished]
    if unfinished or (engine.requests and not all(r.is_finished
                                                  for r in engine.requests.values())):
        _fail(f"sequences not finished: {unfinished}")
    if bm.pool.num_used or any(bm.pool.ref_counts):
        _fail(f"{bm.pool.num_used} GPU blocks still used")
    if bm.cpu_pool.num_used:
        _fail(f"{bm.cpu_pool.num_used} swap (CPU) blocks still used")
    if bm.seqs:
        _fail(f"block manager still tracks sequences {sorted(bm.seqs)}")
    if sched.running or sched.swapped or sched.num_waiting or sched.pending or \
            sched.static_queue:
        _fail("scheduler queues not empty")
    if bm.pending_copies or bm.pending_swap_out or bm.pending_swap_in:
        _fail("block copies / swaps queued but never applied")
