"""Routing policies: hand-computed choices, and the properties the router relies on
(stickiness, balance, minimal movement on removal, the bounded-load cap)."""

import hashlib
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kv.prefix import hash_block_tokens
from labkit.router.policies import (
    LeastOutstanding,
    NoReplicaError,
    PrefixAffinity,
    RoundRobin,
    RouteKey,
    get_policy,
    prefix_key,
)


@dataclass
class R:
    name: str
    outstanding: int = 0


def fleet(n):
    return [R(f"replica-{i}") for i in range(n)]


def key(i, length=128):
    """A prompt whose first block already differs per i (a distinct 'system prompt')."""
    return RouteKey(token_ids=[i * 1000 + j for j in range(length)])


def test_round_robin_cycles():
    rs = fleet(3)
    p = RoundRobin()
    assert [p.choose(RouteKey(), rs).name for _ in range(4)] == [
        "replica-0", "replica-1", "replica-2", "replica-0"]


def test_least_outstanding_picks_min_and_rotates_ties():
    rs = [R("a", 3), R("b", 1), R("c", 2)]
    assert LeastOutstanding().choose(RouteKey(), rs).name == "b"
    p, tied = LeastOutstanding(), [R("a"), R("b"), R("c")]
    assert {p.choose(RouteKey(), tied).name for _ in range(3)} == {"a", "b", "c"}


def test_no_replica_is_a_named_error():
    for p in (RoundRobin(), LeastOutstanding(), PrefixAffinity()):
        with pytest.raises(NoReplicaError, match="no replica"):
            p.choose(key(0), [])
    with pytest.raises(ValueError, match="valid names"):
        get_policy("random")


def test_prefix_key_is_the_engines_chained_block_hash():
    ids = list(range(100, 160))  # 3 full blocks of 16 and a partial one
    b0 = hash_block_tokens(None, ids[:16])
    b1 = hash_block_tokens(b0, ids[16:32])
    got = prefix_key(RouteKey(token_ids=ids), block_size=16, num_blocks=2)
    assert got == int.from_bytes(b1[:8], "little")
    # tokens past the first num_blocks blocks do not matter; a different first block does
    assert prefix_key(RouteKey(token_ids=ids[:32] + [7] * 40), 16, 2) == got
    assert prefix_key(RouteKey(token_ids=[7] + ids[1:]), 16, 2) != got
    # a prompt shorter than K blocks uses the blocks it has; shorter than one has no key
    assert prefix_key(RouteKey(token_ids=ids[:20]), 16, 8) == int.from_bytes(b0[:8], "little")
    assert prefix_key(RouteKey(token_ids=ids[:15]), 16, 8) is None


def test_ring_walk_matches_a_hand_built_ring():
    # one virtual node per replica: the ring is just the sorted sha256 points of the names
    names = ["a", "b", "c", "d"]
    pts = sorted((int.from_bytes(hashlib.sha256(f"{n}#0".encode()).digest()[:8], "little"), n)
                 for n in names)
    p = PrefixAffinity(vnodes=1, eps=None)
    rs = [R(n) for n in names]
    for k in range(20):
        h = prefix_key(key(k))
        succ = next((n for pt, n in pts if pt >= h), pts[0][1])  # clockwise successor, wrapping
        assert p.choose(key(k), rs).name == succ


def test_min_load_keeps_affinity_at_low_load():
    rs = [R("a", 1), R("b", 0), R("c", 0)]
    strict, floor = PrefixAffinity(), PrefixAffinity(min_load=4)
    assert strict.capacity(rs) == math.ceil(1.25 * 2 / 3) == 1  # a holds 1: "full"
    assert floor.capacity(rs) == 4
    busy = [R("a", 9), R("b", 9), R("c", 9)]
    assert floor.capacity(busy) == strict.capacity(busy) == math.ceil(1.25 * 28 / 3)
    key = RouteKey(token_ids=list(range(64)))
    home = next(strict.walk(prefix_key(key), rs))
    for r in rs:
        r.outstanding = int(r is home)
    assert floor.choose(key, rs) is home and strict.choose(key, rs) is not home
    with pytest.raises(ValueError, match="min_load"):
        PrefixAffinity(min_load=-1)


def test_bounded_load_capacity_by_hand():
    p = PrefixAffinity(eps=0.25)
    rs = [R("a", 3), R("b", 1), R("c", 0), R("d", 0)]
    assert p.capacity(rs) == math.ceil(1.25 * 5 / 4) == 2
    # the key's first choice is full: the request walks on to the next replica under the cap
    first = next(iter(p.walk(prefix_key(key(1)), rs)))
    first.outstanding = 5
    order = list(p.walk(prefix_key(key(1)), rs))
    want = next(r for r in order if r.outstanding < p.capacity(rs))
    assert p.choose(key(1), rs) is want is not first


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.permutations(range(12)), st.integers(0, 10**6))
def test_sticky_and_order_independent(n, perm, k):
    rs = fleet(n)
    shuffled = [rs[i] for i in perm if i < n]
    p = PrefixAffinity()
    a = p.choose(key(k), rs).name
    assert p.choose(key(k), rs).name == a
    assert PrefixAffinity().choose(key(k), shuffled).name == a
    # same system prompt, different user suffix past the hashed blocks: same replica
    long = RouteKey(token_ids=list(key(k).token_ids) + [5, 6, 7] * 20)
    assert p.choose(long, rs).name == a


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 16), st.integers(0, 1000))
def test_keys_spread_evenly(n, offset):
    rs = fleet(n)
    p = PrefixAffinity(eps=None)
    counts = {r.name: 0 for r in rs}
    num_keys = 200 * n
    for k in range(num_keys):
        counts[p.choose(key(k + offset * num_keys), rs).name] += 1
    assert max(counts.values()) <= 1.5 * num_keys / n
    assert min(counts.values()) >= 0.5 * num_keys / n


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 12), st.data())
def test_removing_a_replica_moves_only_its_keys(n, data):
    rs = fleet(n)
    gone = data.draw(st.sampled_from(rs))
    p = PrefixAffinity()
    before = {k: p.choose(key(k), rs).name for k in range(300)}
    after = {k: p.choose(key(k), [r for r in rs if r is not gone]).name for k in range(300)}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == gone.name}
    assert moved  # the removed replica did own some keys


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 10), st.sampled_from([0.1, 0.25, 1.0]),
       st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=300))
def test_hot_prefix_never_exceeds_the_bound(n, eps, ops):
    # ops: (which of 4 prefixes - prefix 0 is hot because most draws hit it, finish one?)
    rs = fleet(n)
    p = PrefixAffinity(eps=eps)
    live = []
    for k, finish in ops:
        if finish and live:
            live.pop(0).outstanding -= 1
            continue
        cap = p.capacity(rs)
        r = p.choose(key(0 if k < 3 else k), rs)
        r.outstanding += 1
        live.append(r)
        assert r.outstanding <= cap
    if not any(f for _, f in ops):  # only arrivals: the cap holds for the final total too
        total = sum(r.outstanding for r in rs)
        assert max(r.outstanding for r in rs) <= math.ceil((1 + eps) * total / n)


def test_without_the_bound_a_hot_prefix_melts_one_replica():
    # negative control: eps=None is pure consistent hashing; the default (what `labkit router
    # --policy prefix-affinity` and Cluster use) is bounded: one hot prefix spills over once
    # its replica holds ceil(1.25 x average)
    rs = fleet(4)
    for p, worst in ((PrefixAffinity(eps=None), 100), (get_policy("prefix-affinity"),
                                                        math.ceil(1.25 * 100 / 4))):
        for r in rs:
            r.outstanding = 0
        for _ in range(100):
            p.choose(key(0), rs).outstanding += 1
        assert max(r.outstanding for r in rs) == worst
        assert sum(r.outstanding > 0 for r in rs) == (1 if p.eps is None else 4)
