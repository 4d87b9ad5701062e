"""Property tests: random allocate / append / fork / free / truncate / swap keep the pool sane.

A shadow model of the physical KV (which token sits in which slot of which block) is kept next to
the real manager; every prefix hit must hand back blocks whose shadow contents are exactly the new
sequence's tokens, which checks hashing, copy-on-write and eviction together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.kv.block_manager import BlockManager
from labkit.kv.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError


@dataclass
class FakeSeq:
    seq_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.seq_id


def test_pool_basic_and_double_free():
    p = BlockPool(3)
    a, _ = p.allocate()
    b, _ = p.allocate()
    assert (p.num_used, p.num_free, p.num_cached) == (2, 1, 0)
    p.register(a, b"h")
    assert p.free(a) is True and p.num_cached == 1
    assert p.free(b) is False and p.num_free == 2
    with pytest.raises(BlockPoolError):
        p.free(b)
    # free blocks are preferred over evicting cached ones
    c, ev = p.allocate()
    d, ev2 = p.allocate()
    assert ev is None and ev2 is None and p.lookup(b"h") == a
    e, ev3 = p.allocate()
    assert e == a and ev3 == a and p.lookup(b"h") is None and p.num_evictions == 1
    with pytest.raises(NoFreeBlocksError):
        p.allocate()


def test_lru_evicts_least_recently_freed():
    p = BlockPool(3)
    ids = [p.allocate()[0] for _ in range(3)]
    for i, b in enumerate(ids):
        p.register(b, bytes([i]))
    p.free(ids[1])
    p.free(ids[0])
    p.free(ids[2])
    p.touch(ids[1])  # hit: leaves the LRU
    assert p.allocate() == (ids[0], ids[0])
    assert p.allocate() == (ids[2], ids[2])


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bs = 3
        self.m = BlockManager(num_blocks=12, block_size=self.bs, enable_prefix_caching=True,
                              num_cpu_blocks=6)
        self.seqs: dict[str, FakeSeq] = {}
        self.swapped: dict[str, FakeSeq] = {}
        self.contents: dict[int, dict[int, int]] = {}  # physical block -> {offset: token}
        self.cpu_contents: dict[int, dict[int, int]] = {}
        self.n = 0

    def _apply_pending(self):
        _, copies, outs, ins = self.m.drain()
        for src, dst in copies:
            self.contents[dst] = dict(self.contents.get(src, {}))
        for g, c in outs:
            self.cpu_contents[c] = dict(self.contents.get(g, {}))
        for c, g in ins:
            self.contents[g] = dict(self.cpu_contents.get(c, {}))

    def _compute(self, s: FakeSeq, k: int):
        """Write shadow KV for the next k tokens, as a forward pass would."""
        for p in range(s.num_computed_tokens, s.num_computed_tokens + k):
            blk = s.block_table[p // self.bs]
            self.contents.setdefault(blk, {})[p % self.bs] = s.token_ids[p]
        s.num_computed_tokens += k
        self.m.cache_full_blocks(s)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10),
          salt=st.sampled_from([None, None, "t1"]), chunk=st.integers(1, 10))
    def admit(self, tokens, salt, chunk):
        s = FakeSeq(f"s{self.n}", list(tokens), salt)
        self.n += 1
        blocks, hashes = self.m.find_cached_prefix(s)
        k = min(chunk, len(tokens) - len(blocks) * self.bs)
        if self.m.allocate_slots(s, k, blocks, hashes):
            self._apply_pending()
            for i, b in enumerate(blocks):  # a prefix hit hands back exactly our tokens
                want = {o: tokens[i * self.bs + o] for o in range(self.bs)}
                assert self.contents[b] == want
            self._compute(s, k)
            self.seqs[s.seq_id] = s
        else:
            assert not s.block_table

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 4), lookahead=st.integers(0, 2))
    def append(self, data, k, lookahead):
        s = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        while len(s.token_ids) < s.num_computed_tokens + k:
            s.token_ids.append(data.draw(st.integers(0, 2)))
        if self.m.allocate_slots(s, k, num_lookahead=lookahead):
            self._apply_pending()
            self._compute(s, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        p = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        c = FakeSeq(f"s{self.n}", list(p.token_ids), p.cache_salt, p.num_computed_tokens)
        self.n += 1
        self.m.fork(p, c)
        self.seqs[c.seq_id] = c

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        s = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.m.free(s)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.integers(0, 6))
    def truncate(self, data, keep):
        s = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        keep = min(keep, s.num_computed_tokens)
        self.m.truncate(s, keep)
        s.num_computed_tokens = keep
        del s.token_ids[max(keep, 1):]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        if self.m.can_swap_out(s):
            self.m.swap_out(s)
            self._apply_pending()
            self.swapped[sid] = self.seqs.pop(sid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        s = self.swapped[sid]
        if self.m.can_swap_in(s):
            self.m.swap_in(s)
            self._apply_pending()
            self.seqs[sid] = self.swapped.pop(sid)
            for p in range(s.num_computed_tokens):  # swapped-in KV is intact
                assert self.contents[s.block_table[p // self.bs]][p % self.bs] == s.token_ids[p]

    @invariant()
    def pool_consistent(self):
        pool = self.m.pool
        holders = [0] * pool.num_blocks
        for s in self.seqs.values():
            for b in s.block_table:
                holders[b] += 1
        assert holders == pool.ref_counts
        free, cached = set(pool.free_ids), set(pool.cached_free)
        assert len(free) == len(pool.free_ids) and not (free & cached)
        used = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
        assert not (used & (free | cached))
        assert pool.num_used + pool.num_free + pool.num_cached == pool.num_blocks
        assert len(used) == pool.num_used
        for h, b in pool.hash_to_block.items():
            assert pool.block_hash[b] == h
        for b in cached:
            assert pool.block_hash[b] is not None
        cpu_held = sum(len(s.cpu_block_table) for s in self.swapped.values())
        assert self.m.cpu_pool.num_used == cpu_held
        # KV of every computed token sits where the block table says
        for s in self.seqs.values():
            for p in range(s.num_computed_tokens):
                assert self.contents[s.block_table[p // self.bs]][p % self.bs] == s.token_ids[p]

    def teardown(self):
        for s in list(self.seqs.values()) + list(self.swapped.values()):
            self.m.free(s)
        pool = self.m.pool
        assert pool.num_used == 0 and self.m.cpu_pool.num_used == 0
        assert not self.m.seqs


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_rollback_into_published_block_copies_on_write():
    """After truncating into a full, published block, the next write must not touch it."""
    m = BlockManager(num_blocks=4, block_size=3)
    s = FakeSeq("a", [1, 2, 3, 4])
    assert m.allocate_slots(s, 4)
    s.num_computed_tokens = 4
    m.cache_full_blocks(s)
    published = s.block_table[0]
    m.truncate(s, 2)
    s.num_computed_tokens, s.token_ids = 2, [1, 2, 9]
    assert m.allocate_slots(s, 1)
    events, copies, _, _ = m.drain()
    assert copies == [(published, s.block_table[0])] and s.block_table[0] != published
    other = FakeSeq("b", [1, 2, 3, 7])
    blocks, _ = m.find_cached_prefix(other)
    assert blocks == [published]


def test_prefix_hit_recomputes_last_token_of_aligned_prompt():
    m = BlockManager(num_blocks=8, block_size=2)
    a = FakeSeq("a", [5, 6, 7, 8])
    assert m.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    m.cache_full_blocks(a)
    b = FakeSeq("b", [5, 6, 7, 8])
    blocks, hashes = m.find_cached_prefix(b)
    assert blocks == a.block_table[:1]  # block 2 holds the last token: recomputed
    salted = FakeSeq("c", [5, 6, 7, 8], cache_salt="tenant-2")
    assert m.find_cached_prefix(salted) == ([], [])
    assert m.allocate_slots(b, 2, blocks, hashes) and b.num_computed_tokens == 2
    assert m.stats()["prefix_hit_tokens"] == 2


def test_multi_block_write_copies_every_shared_block():
    """A fork shares the parent's lookahead blocks too; a later multi-token write by either
    (a chunk or a verify pass) that spans several shared blocks must copy each of them, not
    only the first (found by the state machine above: the sibling's KV was overwritten)."""
    m = BlockManager(num_blocks=12, block_size=3)
    a = FakeSeq("a", [5, 6, 7, 8, 9])
    assert m.allocate_slots(a, 5, num_lookahead=2)  # positions 0..6: blocks 0, 1, 2
    a.num_computed_tokens = 5
    b = FakeSeq("b", list(a.token_ids), None, 5)
    m.fork(a, b)
    assert b.block_table == a.block_table and len(a.block_table) == 3
    shared = list(a.block_table)
    a.token_ids += [1, 2, 3]
    assert m.allocate_slots(a, 3)  # writes positions 5, 6, 7: logical blocks 1 and 2
    _, copies, _, _ = m.drain()
    assert a.block_table[0] == shared[0]  # not written: still shared
    assert a.block_table[1] != shared[1] and a.block_table[2] != shared[2]
    assert sorted(src for src, _ in copies) == sorted(shared[1:])
    assert b.block_table == shared and m.pool.ref_counts[shared[1]] == 1
